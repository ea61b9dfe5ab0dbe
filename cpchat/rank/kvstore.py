"""KVShard: this rank's share of the conversation's keys and values.

Positions are global, so masks never depend on where a token lives. Every
layer stores the tokens this rank owns, except that a sliding-window layer may
`forget` keys no later query can see; so each layer keeps its own positions,
and `positions` lists the tokens the rank owns (what it reports and rolls back).
Buffers grow in steps, as mlx-lm's KVCache does, and keep room for GROW more
tokens whenever they grow, so neither a decode append nor the first one after a
prefill copies the whole shard (at 16K tokens such a copy takes a quarter of a
second: the fresh memory's pages are what cost). With `--kv-bits` the shard
turns quantized when the engine says (`quantize`, cpchat.core.quantized_kv):
from then on a layer's keys and values are `Packed` (words, scales, biases) and
every append is quantized as it arrives.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import (
    FULL_PRECISION,
    KV,
    KVFormat,
    Packed,
    apply,
    arrays_of,
    packed,
    quantize,
    take,
)

GROW = 256


class KVShard:
    def __init__(self, num_layers: int, linear: frozenset[int] = frozenset(),
                 kv_format: KVFormat = FULL_PRECISION, elsewhere: frozenset[int] = frozenset()) -> None:
        self.num_layers = num_layers
        self.linear = linear  # layers that keep a recurrent state instead (cpchat.rank.statestore)
        self.elsewhere = elsewhere  # layers another pipeline stage runs (cpchat.rank.stages)
        self.format = kv_format
        self.quantized = False  # whether the layers hold (and append) Packed keys and values
        self.keys: list[KV | None] = [None] * num_layers
        self.values: list[KV | None] = [None] * num_layers
        self.positions = np.zeros(0, dtype=np.int32)
        self._layer_positions = [self.positions] * num_layers
        self._pending: np.ndarray | None = None  # positions being appended by the current forward
        self._lengths = [0] * num_layers

    @property
    def without_kv(self) -> frozenset[int]:
        """Layers that hold no keys and values here."""
        return self.linear | self.elsewhere

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held, from shapes alone (safe to call from the stats thread)."""
        return sum(
            n * a.shape[1] * a.shape[3] * a.dtype.size
            for n, k, v in zip(self._lengths, self.keys, self.values)
            for kv in (k, v)
            if kv is not None
            for a in arrays_of(kv)
        )

    def begin_append(self, positions: np.ndarray) -> None:
        """Positions of the tokens the next forward will append (same for every layer)."""
        self._pending = positions.astype(np.int32)

    def append(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Append [1, Hkv, n, D] keys/values of the pending positions to one layer (quantized ones
        too, to a quantized shard)."""
        if self.quantized:
            keys, values = packed(keys, self.format), packed(values, self.format)
        n_new = keys.shape[2]
        start = self._lengths[layer]
        buf = self.keys[layer]
        if buf is None or start + n_new > buf.shape[2]:
            capacity = (start + n_new + 2 * GROW - 1) // GROW * GROW
            self.keys[layer] = _grown(buf, keys, start, capacity)
            self.values[layer] = _grown(self.values[layer], values, start, capacity)  # MLA: own size
        for buf, new in ((self.keys[layer], keys), (self.values[layer], values)):
            for b, a in zip(arrays_of(buf), arrays_of(new), strict=True):
                b[..., start : start + n_new, :] = a
        self._lengths[layer] = start + n_new

    def quantize(self) -> None:
        """Hold every layer's keys and values quantized from now on (mlx-lm's to_quantized)."""
        for i in range(self.num_layers):
            n = self._lengths[i]
            if n == 0:
                self.keys[i] = self.values[i] = None
            elif not isinstance(self.keys[i], Packed):
                self.keys[i] = quantize(self.keys[i][..., :n, :], self.format)
                self.values[i] = quantize(self.values[i][..., :n, :], self.format)
        self.quantized = True
        mx.eval(self._arrays())

    def _arrays(self) -> list[mx.array]:
        return [a for kv in self.keys + self.values if kv is not None for a in arrays_of(kv)]

    def commit(self, evaluate: bool = True) -> None:
        """The forward finished: its positions belong to the shard, and its K/V are computed (or,
        not `evaluate`d, still a graph: a pipelined decode step's)."""
        if evaluate:
            mx.eval(self._arrays())
        if self._pending is not None:
            self.positions = np.concatenate([self.positions, self._pending])
            self._layer_positions = [np.concatenate([p, self._pending]) for p in self._layer_positions]
            self._pending = None
        assert all(n == len(p) for i, (n, p) in enumerate(zip(self._lengths, self._layer_positions))
                   if i not in self.without_kv), "layers out of step"

    def layer(self, layer: int) -> tuple[KV | None, KV | None, np.ndarray]:
        """Keys, values and positions of one layer, the pending append included."""
        n = self._lengths[layer]
        positions = self._layer_positions[layer]
        if self._pending is not None:
            positions = np.concatenate([positions, self._pending])
        if n == 0:
            return None, None, positions[:0]
        return _head(self.keys[layer], n), _head(self.values[layer], n), positions[:n]

    def fill(self, positions: np.ndarray, layers: dict[int, tuple[KV, KV, np.ndarray]],
             quantized: bool = False) -> None:
        """Hold these tokens: each attention layer's keys, values and their positions (a saved prefix)."""
        self._pending = None
        self.quantized = quantized
        self.positions = positions.astype(np.int32)
        for i in range(self.num_layers):
            keys, values, held = layers.get(i, (None, None, self.positions[:0]))
            self.keys[i], self.values[i] = keys, values
            self._layer_positions[i] = self.positions if i in self.without_kv else held.astype(np.int32)
            self._lengths[i] = 0 if keys is None else keys.shape[2]
        mx.eval(self._arrays())

    def layer_positions(self, layer: int) -> np.ndarray:
        return self._layer_positions[layer]

    def truncate(self, keep_positions_below: int) -> None:
        """Forget every token at or after a global position (and any pending append); forgetting
        them all starts a conversation afresh, in full precision."""
        self._pending = None
        if keep_positions_below <= 0:
            self.quantized = False
            self.keys, self.values = [None] * self.num_layers, [None] * self.num_layers
        self.positions = self.positions[self.positions < keep_positions_below]
        for layer in range(self.num_layers):
            self._keep(layer, self._layer_positions[layer] < keep_positions_below)

    def forget(self, layer: int, drop: np.ndarray) -> None:
        """Drop one layer's keys and values where `drop` is true (a sliding window's old keys);
        the tokens stay the rank's."""
        self._keep(layer, ~drop)

    def _keep(self, layer: int, keep: np.ndarray) -> None:
        """Keep the layer's tokens where `keep` is true: dropping a tail (a roll back) copies nothing."""
        n = len(self._layer_positions[layer])
        if self.keys[layer] is not None and not keep[:int(keep.sum())].all():
            index = mx.array(np.flatnonzero(keep))
            self.keys[layer] = take(_head(self.keys[layer], n), index, axis=2)
            self.values[layer] = take(_head(self.values[layer], n), index, axis=2)
            mx.eval(arrays_of(self.keys[layer]), arrays_of(self.values[layer]))
        self._layer_positions[layer] = self._layer_positions[layer][keep]
        self._lengths[layer] = len(self._layer_positions[layer])


def _head(x: KV, n: int) -> KV:
    """The first n tokens of a buffer."""
    return apply(x, lambda a: a[..., :n, :])


def _grown(buf: KV | None, like: KV, used: int, capacity: int) -> KV:
    """A buffer of `capacity` tokens shaped like `like`, holding the first `used` tokens of `buf`."""
    grown = apply(like, lambda a: mx.zeros((1, a.shape[1], capacity, a.shape[3]), a.dtype))
    if buf is not None and used:
        for g, b in zip(arrays_of(grown), arrays_of(buf), strict=True):
            g[..., :used, :] = b[..., :used, :]
    return grown
