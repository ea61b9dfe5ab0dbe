"""A loaded model's measured prefill cost, kept on disk: measuring takes a few seconds a load (tens for
a large model), and a rank that loads the same model on the same machine again needs no new numbers.

An entry is keyed by what the speed depends on: the model's structure (its config and each weight's
shape and dtype, not their values: a fine-tune of the same base shares it), the layers this rank runs,
the machine (CPU, device, MLX, the BLAS library and its threads, the CPU allowance) and the measuring
code itself. It is measured again after MAX_AGE_S, so one taken on a busy machine does not last."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from cpchat import blas
from cpchat.core.estimate import PrefillCost
from cpchat.core.memory import ForwardMemory

MAX_AGE_S = 7 * 24 * 3600
_MEASURING_CODE = Path(__file__).with_name("calibration.py")


def measure_key(structure: str, first_layer: int, end_layer: int, weight_bytes: int) -> str:
    """What a model's measured cost on this rank depends on (model_load.structure: the model's), hashed."""
    library = blas.in_use()
    parts = [structure, first_layer, end_layer, weight_bytes, blas.cpu_name(), str(mx.default_device()),
             mx.__version__, library.library, library.threads, blas.cpu_allowance()]
    digest = hashlib.sha256(json.dumps(parts).encode())
    digest.update(_MEASURING_CODE.read_bytes())
    return digest.hexdigest()


Measured = tuple[PrefillCost, ForwardMemory]


class MeasureStore:
    """Measured costs under `root`, one small JSON file a key (None: none kept)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def measured(self, key: str, measure: Callable[[], Measured]) -> Measured:
        """The kept entry, else `measure()`'s, then kept. Ranks of one machine that load a model together
        take turns: the first measures alone, the others read its numbers (the same for all of them)."""
        if self.root is None:
            return measure()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / f"{key}.lock", "w")  # noqa: SIM115  (held until measured)
        except OSError:
            return measure()  # a read-only cache: measure at every load, as without one
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kept = self.get(key)
            if kept is None:
                kept = measure()
                self.put(key, *kept)
            return kept

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

    def put(self, key: str, cost: PrefillCost, memory: ForwardMemory) -> None:
        if self.root is None:
            return
        entry = {"prefill": dataclasses.asdict(cost), "memory": dataclasses.asdict(memory)}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            temporary = self.root / f"{key}.{os.getpid()}.tmp"
            temporary.write_text(json.dumps(entry))
            os.replace(temporary, self.root / f"{key}.json")
        except OSError:
            pass
