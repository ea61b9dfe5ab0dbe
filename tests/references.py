"""mlx-lm's reference outputs, computed once per version and kept on disk.

Each reference (tests/mlx_reference.py computes them) is one JSON file in CPCHAT_TEST_REFERENCE_DIR
(default ~/.cache/cpchat-tests/references), named by a digest of everything that can change it: the
versions of mlx, mlx-lm and numpy; the platform, CPU, device and BLAS of the process that computes it;
the model directory's bytes; the token ids and every generation argument; and the reference code itself
(this file and mlx_reference.py). The file keeps those fields, for audit, and a digest of its value: an
entry that cannot be read, or whose fields or digest do not match, is computed again and rewritten.
CPCHAT_TEST_REFERENCES=fresh computes every reference a run meets. Within a run each is computed once.
Only the oracle's answers are kept here, never cpchat's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import mlx_reference as oracle
import numpy as np

from cpchat import blas
from cpchat.bench.report import machine as bench_machine
from cpchat.client.launcher import rank_environment
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat

CODE = (Path(__file__), Path(oracle.__file__))

Pairs = list[tuple[int, float]]


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


@dataclass
class Store:
    """Entries on disk under `root`, and the ones this run has met in memory."""

    root: Path
    fresh: bool = False
    met: dict[str, Any] = field(default_factory=dict)

    def get(self, fields: dict, compute: Callable[[], Any]) -> Any:
        """The stored value for `fields`, or `compute()`'s, stored."""
        value = self.lookup(fields)
        if value is None:
            value = compute()
            self.save(fields, value)
        return value

    def lookup(self, fields: dict) -> Any | None:
        """The value this run has met for `fields`, or the one on disk (unless fresh), or None."""
        key = digest(fields)
        if key not in self.met and not self.fresh:
            value = self.read(key, fields)
            if value is not None:
                self.met[key] = value
        return self.met.get(key)

    def save(self, fields: dict, value: Any) -> None:
        key = digest(fields)
        self.met[key] = value
        self.write(key, fields, value)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def read(self, key: str, fields: dict) -> Any | None:
        try:
            entry = json.loads(self.path(key).read_bytes())
            if entry["fields"] == fields and entry["value_sha256"] == digest(entry["value"]):
                return entry["value"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            pass
        warnings.warn(f"reference {self.path(key)} is damaged; computing it again", stacklevel=3)
        return None

    def write(self, key: str, fields: dict, value: Any) -> None:
        """Atomically: a reader sees the old entry, or none, or the whole new one."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = {"fields": fields, "value": value, "value_sha256": digest(value)}
        with tempfile.NamedTemporaryFile("wb", dir=self.root, suffix=".tmp", delete=False) as f:
            f.write(canonical(entry))
        os.replace(f.name, self.path(key))


STORE = Store(Path(os.environ.get("CPCHAT_TEST_REFERENCE_DIR")
                   or Path.home() / ".cache" / "cpchat-tests" / "references"),
              fresh=os.environ.get("CPCHAT_TEST_REFERENCES") == "fresh")


@functools.cache
def code_digest() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in CODE)).hexdigest()


@functools.cache
def _model_digest(path: Path, stamp: tuple) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def model_digest(path: Path) -> str:
    """A digest of the bytes of the model directory (weights, config, tokenizer), read once per version of
    its files."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return _model_digest(path, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.cache
def machine() -> dict:
    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__,
            "platform": f"{sys.platform} {platform.machine()}", "cpu": bench_machine()["cpu"],
            "device": str(mx.default_device())}


@functools.cache
def test_process_blas() -> str:
    info = blas.in_use()
    return f"{info.label} {Path(info.library).name} threads {info.threads}"


@functools.cache
def worker_blas() -> str:
    """The BLAS a worker started with rank_environment() multiplies with (the library it preloads)."""
    env = rank_environment()
    kind, path = blas.choose("auto")
    return f"{kind} {path.resolve().name if path else ''} threads {env['OPENBLAS_NUM_THREADS']}"


def fields(kind: str, path: Path, process_blas: str, **arguments: Any) -> dict:
    return {"kind": kind, **machine(), "blas": process_blas, "code": code_digest(),
            "model": model_digest(path), **arguments}


def in_test_process(kind: str, path: Path, compute: Callable[[], Any], **arguments: Any) -> Any:
    return STORE.get(fields(kind, path, test_process_blas(), **arguments), compute)


# ---- the references the tests ask for


def reference_tokenizer(path: Path):
    """mlx-lm's tokenizer for `path`, which the tests build their prompts with."""
    return oracle.load(Path(path))[1]


def reference_generate(path: Path, ids: list[int], max_tokens: int) -> Pairs:
    """mlx-lm's own single-process greedy tokens and their logprobs."""
    steps = in_test_process("generate", path, lambda: oracle.generate(path, ids, max_tokens),
                            ids=list(ids), max_tokens=max_tokens, sampler="greedy")
    return [(t, lp) for t, lp in steps]


def reference_top_logprobs(path: Path, ids: list[int], max_tokens: int, top: int) -> list[Pairs]:
    """The `top` most likely tokens at each step of mlx-lm's greedy generation, with their logprobs."""
    steps = in_test_process("generate", path, lambda: oracle.generate(path, ids, max_tokens, top),
                            ids=list(ids), max_tokens=max_tokens, sampler="greedy", top=top)
    return [[(t, lp) for t, lp in best] for _, _, best in steps]


def low_precision_noise(path: Path, ids: list[int], expected: Pairs) -> float:
    """mlx-lm's own low-precision noise over the prompt and its answer `expected`
    (mlx_reference.low_precision_noise)."""
    expected = [[t, lp] for t, lp in expected]
    compute = lambda: oracle.low_precision_noise(path, ids, expected)  # noqa: E731
    return in_test_process("low_precision_noise", path, compute, ids=list(ids), expected=expected)


def tie_scores(path: Path, prefix: list[int], tokens: list[int]) -> list[list[float]]:
    return in_test_process("tie_scores", path, lambda: oracle.tie_scores(path, prefix, tokens),
                           prefix=list(prefix), tokens=list(tokens))


def quantized_reads(path: Path, turns: list[int], start: int) -> list[tuple[int, bool]]:
    calls = in_test_process("quantized_reads", path, lambda: oracle.quantized_reads(path, turns, start),
                            turns=turns, quantized_kv_start=start, kv_bits=4, kv_group_size=64)
    return [(offset, quantized) for offset, quantized in calls]


@dataclass(frozen=True)
class Request:
    ids: tuple[int, ...]
    max_tokens: int
    conversation: tuple[Request, ...]  # the requests of its conversation before it, in order


class MlxReference:
    """mlx-lm's answers for one checkpoint (and K/V format) from a worker process (mlx_reference.py, run
    with the fast BLAS the ranks use), as `(answer, noise)`: the greedy (token, logprob) pairs and mlx-lm's
    own low-precision noise over them. The worker keeps a conversation's prompt cache between requests
    whose ids extend the last one's, as mlx-lm's chat does, so an answer depends on the conversation so
    far: that is part of its key. The worker starts on the first answer not on disk, and goes through
    the requests of that answer's conversation first when it did not just answer them."""

    def __init__(self, path: Path, kv: KVFormat = FULL_PRECISION) -> None:
        self.path, self.kv = path, kv
        self.worker: subprocess.Popen | None = None
        self.asked: dict[tuple, Request] = {}  # (ids, max_tokens) -> the request first asked so
        self.answers: dict[Request, tuple[Pairs, float]] = {}
        self.pending: list[Request] = []  # sent to the worker, not answered yet, in order
        self.last: Request | None = None
        self.worker_read: tuple[Request, ...] = ()  # the worker's conversation so far

    def submit(self, ids: list[int], max_tokens: int) -> None:
        """Ask without waiting: the worker computes while the caller goes on."""
        if (tuple(ids), max_tokens) in self.asked:
            return
        last = self.last
        extends = last is not None and len(ids) > len(last.ids) and tuple(ids[:len(last.ids)]) == last.ids
        request = Request(tuple(ids), max_tokens, (*last.conversation, last) if extends else ())
        self.asked[request.ids, max_tokens] = self.last = request
        stored = STORE.lookup(self.fields(request))
        if stored is not None:
            self.answers[request] = [(t, lp) for t, lp in stored["answer"]], stored["noise"]
            return
        if self.worker_read != request.conversation:
            for i, earlier in enumerate(request.conversation):
                self.send(earlier, reset=i == 0)
        self.send(request, reset=not request.conversation)
        self.worker_read = (*request.conversation, request)

    def __call__(self, ids: list[int], max_tokens: int) -> tuple[Pairs, float]:
        self.submit(ids, max_tokens)
        request = self.asked[tuple(ids), max_tokens]
        while request not in self.answers:
            reply = json.loads(self.worker.stdout.readline())
            answered = self.pending.pop(0)
            self.answers[answered] = [(t, lp) for t, lp in reply["answer"]], reply["noise"]
            STORE.save(self.fields(answered), reply)
        return self.answers[request]

    def fields(self, request: Request) -> dict:
        conversation = [[list(r.ids), r.max_tokens] for r in (*request.conversation, request)]
        return fields("worker", self.path, worker_blas(), conversation=conversation, sampler="greedy",
                      kv_bits=self.kv.bits, kv_group_size=self.kv.group_size,
                      quantized_kv_start=self.kv.start)

    def send(self, request: Request, reset: bool) -> None:
        if self.worker is None:
            self.worker = subprocess.Popen(
                [sys.executable, oracle.__file__, str(self.path), str(self.kv.bits), str(self.kv.group_size),
                 str(self.kv.start)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=rank_environment(),
                text=True)
        line = {"ids": list(request.ids), "max_tokens": request.max_tokens, "reset": reset}
        self.worker.stdin.write(json.dumps(line) + "\n")
        self.worker.stdin.flush()
        self.pending.append(request)

    def close(self) -> None:
        if self.worker is None:
            return
        if self.pending:  # a test failed before it read its answer: do not wait for it
            self.worker.kill()
        self.worker.stdin.close()
        self.worker.wait(timeout=60)
