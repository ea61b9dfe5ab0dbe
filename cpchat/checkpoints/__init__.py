"""Checkpoints in forms mlx-lm cannot load, made into mlx-lm model directories once and cached:
GGUF files (llama.cpp, LM Studio), Ollama's store, and the named models cpchat can fetch.

The front end and every rank call the same code: a rank given a GGUF path converts on its own disk.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, said in one line (the file, and why)."""


@contextlib.contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Held while `entry` of a cache is made: ranks on one host that want it at once make it once."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
