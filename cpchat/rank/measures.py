"""A loaded model's measured prefill cost, kept on disk: measuring takes a few seconds a load (tens for
a large model), and a rank that loads the same model on the same machine again needs no new numbers.

An entry is keyed by what the speed depends on: the model's structure (its config and each weight's
shape and dtype, not their values: a fine-tune of the same base shares it), the layers this rank runs,
the machine (CPU, device, MLX, the BLAS library and its threads, the CPU allowance, the ranks that
share it) and the measuring code itself. It is measured again after MAX_AGE_S, so one taken on a
busy machine does not last."""

from __future__ import annotations

import contextlib
import dataclasses
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
Measured = tuple[PrefillCost, ForwardMemory]


class MeasureStore:
    """Measured costs under `root`, one small JSON file a key (None: none kept), made by ranks of which
    `ranks_here` share this machine: they measure together, each slowed by the others as in a prefill,
    so a measure made beside another number of ranks is not theirs."""

    def __init__(self, root: Path | None, ranks_here: int = 1) -> None:
        self.root = root
        self.ranks_here = ranks_here

    def key(self, structure: str, first_layer: int, end_layer: int, weight_bytes: int) -> str:
        """What a model's measured cost here depends on (`structure`: model_load.structure's), hashed."""
        library = blas.in_use()
        parts = [structure, first_layer, end_layer, weight_bytes, blas.cpu_name(), str(mx.default_device()),
                 mx.__version__, library.library, library.threads, blas.cpu_allowance(), self.ranks_here]
        digest = hashlib.sha256(json.dumps(parts).encode())
        digest.update(_MEASURING_CODE.read_bytes())
        return digest.hexdigest()

    def measured(self, key: str, measure: Callable[[], Measured]) -> Measured:
        """The kept entry, else `measure()`'s, kept. Ranks that measure together keep the first one's
        and use it, so that ranks on one machine report one cost."""
        return self.get(key) or self.put(key, *measure())

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
        """Keep this entry, unless another rank kept a fresh one meanwhile: then that one; either way
        the entry kept (or this one, where nothing can be kept)."""
        if self.root is None:
            return cost, memory
        path = self.root / f"{key}.json"
        temporary = self.root / f"{key}.{os.getpid()}.tmp"
        entry = {"prefill": dataclasses.asdict(cost), "memory": dataclasses.asdict(memory)}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(entry))
            try:
                os.link(temporary, path)  # only where there is none
            except FileExistsError:
                if (kept := self.get(key)) is not None:
                    return kept
                os.replace(temporary, path)  # an old or damaged one
        except OSError:
            pass  # a read-only cache: measure at every load, as without one
        finally:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
        return cost, memory
