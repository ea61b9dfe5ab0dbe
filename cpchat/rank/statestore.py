"""StateStore: what the linear-attention layers carry from one forward to the next.

Every rank holds all of it (decode runs the new token on every rank), per layer:
- `state`: the recurrent state after the last token held, float32 [1, H, Dv, Dk];
- `halo`: the layer's inputs at the last kernel-1 positions, [1, kernel-1, D], which
  the short causal convolution before the recurrence reads again; `halo_real` says which
  of those positions exist (a conversation shorter than the kernel has fewer).

A state cannot be cut back to an earlier position, so the store keeps snapshots at the
positions a later turn may roll back to (the start and the prompt end of the last request).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class LayerState:
    state: mx.array | None
    halo: mx.array | None
    halo_real: np.ndarray


class StateStore:
    def __init__(self) -> None:
        self.layers: dict[int, LayerState] = {}
        self.snapshots: dict[int, dict[int, LayerState]] = {0: {}}  # before the first token: nothing

    def layer(self, layer: int, halo: int, like: mx.array) -> LayerState:
        """A layer's state, empty (no state, a halo of positions that do not exist) before its first token."""
        if layer not in self.layers:
            halo_inputs = mx.zeros((1, halo, like.shape[-1]), like.dtype)
            self.layers[layer] = LayerState(None, halo_inputs, np.zeros(halo, bool))
        return self.layers[layer]

    def set(self, layer: int, **changes) -> None:
        self.layers[layer] = replace(self.layers[layer], **changes)

    @property
    def nbytes(self) -> int:
        """Bytes of the live states and halos (safe to call from the stats thread)."""
        return sum(a.nbytes for s in self.layers.values() for a in (s.state, s.halo) if a is not None)

    def snapshot(self, position: int, keep: set[int]) -> None:
        """Remember the states as they are at `position`; forget snapshots not in `keep`."""
        mx.eval([a for s in self.layers.values() for a in (s.state, s.halo) if a is not None])
        self.snapshots = {p: s for p, s in self.snapshots.items() if p in keep or p == 0}
        self.snapshots[position] = dict(self.layers)

    def restore(self, position: int) -> None:
        self.layers = dict(self.snapshots[position])
