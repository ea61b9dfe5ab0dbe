"""A loaded model's measured prefill cost, kept on disk: measuring takes a few seconds a load (tens for
a large model), and a rank that loads the same model on the same machine again needs no new numbers.

An entry is keyed by what the speed depends on: the model's structure (its config and each weight's
shape and dtype, not their values: a fine-tune of the same base shares it), the layers this rank runs,
the machine (CPU, device, MLX, the BLAS library and its threads, the CPU allowance) and the measuring
code itself. It is measured alone (ranks that load together take turns) and read scaled by how many
ranks share the machine's cores, so one entry serves a cluster of any size. It is measured again after
MAX_AGE_S, so one taken on a busy machine does not last."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from cpchat import blas
from cpchat.core.estimate import PrefillCost
from cpchat.core.memory import ForwardMemory

MAX_AGE_S = 7 * 24 * 3600
_MEASURING_CODE = Path(__file__).with_name("calibration.py")
Measured = tuple[PrefillCost, ForwardMemory]


def oversubscription(ranks_here: int, threads: int, cores: float) -> float:
    """How many times slower each of `ranks_here` ranks, `threads` BLAS threads each, works on `cores`
    when all of them work at once (as in a prefill) than one measured alone."""
    return max(1.0, ranks_here * threads / cores)


@contextlib.contextmanager
def measuring_alone() -> Iterator[None]:
    """One measurement at a time on this machine, whatever cache each rank keeps: the others wait idle."""
    path = Path(tempfile.gettempdir()) / f"cpchat-measuring-{os.getuid()}.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class MeasureStore:
    """Measured costs under `root`, one small JSON file a key (None: none kept), read by ranks of which
    `ranks_here` share this machine's cores."""

    def __init__(self, root: Path | None, ranks_here: int = 1) -> None:
        self.root = root
        self.ranks_here = ranks_here

    def key(self, structure: str, first_layer: int, end_layer: int, weight_bytes: int) -> str:
        """What a model's measured cost here depends on (`structure`: model_load.structure's), hashed."""
        library = blas.in_use()
        parts = [structure, first_layer, end_layer, weight_bytes, blas.cpu_name(), str(mx.default_device()),
                 mx.__version__, library.library, library.threads, blas.cpu_allowance()]
        digest = hashlib.sha256(json.dumps(parts).encode())
        digest.update(_MEASURING_CODE.read_bytes())
        return digest.hexdigest()

    def measured(self, key: str, measure: Callable[[], Measured]) -> Measured:
        """The kept entry, else `measure()`'s (taken alone), kept; its times scaled by the cores' sharing."""
        with measuring_alone():
            cost, memory = self.get(key) or self.put(key, *measure())
        sharing = oversubscription(self.ranks_here, blas.in_use().threads, blas.cpu_allowance())
        return cost.scaled(sharing), memory

    def get(self, key: str) -> Measured | None:
        """None for a missing, unreadable or old entry."""
        if self.root is None:
            return None
        path = self.root / f"{key}.json"
        try:
            if time.time() - path.stat().st_mtime > MAX_AGE_S:
                return None
            entry = json.loads(path.read_text())
            return PrefillCost(**entry["prefill"]), ForwardMemory(**entry["memory"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, cost: PrefillCost, memory: ForwardMemory) -> Measured:
        """Keep this entry where it can be kept (a read-only cache: measured at every load)."""
        if self.root is not None:
            temporary = self.root / f"{key}.{os.getpid()}.tmp"
            entry = {"prefill": dataclasses.asdict(cost), "memory": dataclasses.asdict(memory)}
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                temporary.write_text(json.dumps(entry))
                os.replace(temporary, self.root / f"{key}.json")
            except OSError:
                with contextlib.suppress(OSError):
                    temporary.unlink(missing_ok=True)
        return cost, memory
