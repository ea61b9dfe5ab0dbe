"""A GGUF file made into an mlx-lm model directory once, in the user's cache.

The directory is named by the file's size, modification time and a hash of its header (and this
converter's version), so a changed or replaced file converts again and an unchanged one does not.
It is written beside its final name and renamed into place when whole, under a lock, so ranks on
one host that load the same file at once convert it once and never see half a directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from cpchat.checkpoints import cache_lock
from cpchat.checkpoints.gguf_config import mlx_config
from cpchat.checkpoints.gguf_file import GGUFFile, read_gguf
from cpchat.checkpoints.gguf_tokenizer import end_of_turn_ids, tokenizer_files
from cpchat.checkpoints.gguf_weights import GROUP_SIZE, NOT_WEIGHTS, mlx_weights

CONVERTER_VERSION = 1
SHARD_BYTES = 4 << 30
DONE = "cpchat-gguf.json"  # written last: a directory without it is not a conversion

Report = Callable[[int, int], None]  # (tensors done, tensors in all)


def converted_dir(path: Path, cache: Path, tokenizer_only: bool = False, name: str | None = None,
                  report: Report | None = None, say: Callable[[str], None] | None = None) -> Path:
    """The mlx-lm directory for the GGUF file at `path` (the tokenizer alone with `tokenizer_only`),
    converting it into `cache/<name or the file's stem>-<key>` if it is not there yet. `say` gets a
    line before a conversion and one when tensors had to be requantized (stderr by default)."""
    path = path.expanduser().resolve()
    f = read_gguf(path)
    try:
        stat = path.stat()
        key = hashlib.sha256(f"{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:{f.header_digest}"
                             .encode()).hexdigest()[:16]
        target = cache / f"{name or path.stem}-{key}{'-tokenizer' if tokenizer_only else ''}"
        if (target / DONE).exists():
            return target
        say = say or _stderr
        with cache_lock(target):
            if not (target / DONE).exists():
                say(f"converting {path.name} to an mlx-lm model, once: {target}")
                partial = cache / f".{target.name}.partial"
                shutil.rmtree(partial, ignore_errors=True)
                try:
                    write_model(f, partial, tokenizer_only, report, say)
                except BaseException:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
                shutil.rmtree(target, ignore_errors=True)
                partial.rename(target)
        return target
    finally:
        f.close()


def write_model(f: GGUFFile, directory: Path, tokenizer_only: bool, report: Report | None,
                say: Callable[[str], None]) -> None:
    """config.json, the tokenizer files and (unless tokenizer_only) the weights, then DONE."""
    directory.mkdir(parents=True)
    config = mlx_config(f)
    config["eos_token_id"] = end_of_turn_ids(f)
    for name, text in tokenizer_files(f).items():
        (directory / name).write_text(text, encoding="utf-8")
    requantized: dict[str, int] = {}
    if not tokenizer_only:
        weight_map = write_weights(f, config, directory, report, requantized)
        if any(name.endswith(".scales") for name in weight_map):
            # the default; mlx-lm reads each layer's own bits from the shapes of its arrays
            config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if requantized:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(requantized.items()))
        say(f"{f.path.name}: requantized to MLX's form (no exact equivalent): {counts}")
    source = {"source": str(f.path), "converter": CONVERTER_VERSION, "requantized": requantized}
    (directory / DONE).write_text(json.dumps(source, indent=2), encoding="utf-8")


def write_weights(f: GGUFFile, config: dict, directory: Path, report: Report | None,
                  requantized: dict[str, int]) -> dict[str, str]:
    """The weights as safetensors shards of at most SHARD_BYTES, with mlx-lm's index; returns the index's
    weight map (array name -> file)."""
    weight_map: dict[str, str] = {}
    pending: dict[str, mx.array] = {}
    tensors = sum(not name.startswith(NOT_WEIGHTS) for name in f.tensors)

    def flush() -> None:
        if pending:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            mx.save_safetensors(str(directory / name), pending, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(pending, name))
            pending.clear()

    for done, (prefix, arrays, note) in enumerate(mlx_weights(f, config), start=1):
        if note:
            requantized[note] = requantized.get(note, 0) + 1
        if sum(a.nbytes for a in (*pending.values(), *arrays.values())) > SHARD_BYTES:
            flush()
        for kind, array in arrays.items():
            mx.eval(array)
            pending[f"{prefix}.{kind}"] = array
        if report:
            report(done, tensors)
    flush()
    size = sum((directory / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    return weight_map


def _stderr(line: str) -> None:
    print(f"cpchat: {line}", file=sys.stderr, flush=True)
