"""What a rank saves of a conversation, and how it takes it back: its KV shard and the linear layers'
states, as the named arrays of one prefix file (cpchat/rank/prefix_file.py).

Arrays:  tokens · positions (the tokens this rank owns) · layer{i}.keys/.values/.positions for each
attention layer (once the shard is quantized, layer{i}.keys.words/.scales/.biases and the same for
values: the file holds the quantized form) · state{p}.layer{i}.state/.halo/.halo_real for each linear
layer at each position p its state was kept at (the whole ring's: every rank holds the same states).

Any split of the positions over the ranks gives the same attention (masks use global positions and
partial outputs merge exactly), so a ring of another size can take a saved prefix too: each of its
ranks keeps the positions a prefill would have given it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import KV, KVFormat, Packed, concatenate, take
from cpchat.rank.kvstore import KVShard
from cpchat.rank.statestore import LayerState, StateStore
from cpchat.rank.transport.wire import DTYPES

Arrays = dict[str, mx.array | np.ndarray]


def capture(kv: KVShard, states: StateStore, tokens: np.ndarray, windows: Sequence[int | None],
            before_forgetting: dict[int, tuple[mx.array, mx.array, np.ndarray]],
            prompt_end: int) -> tuple[dict, Arrays]:
    """This rank's share of the conversation, as arrays evaluated here (the MLX thread) and readable
    anywhere. `before_forgetting`: sliding-window layers' keys as the prefill left them, before they
    forgot the ones only earlier queries see, so that a shorter cut of the prefix can be loaded."""
    total = len(tokens)
    arrays: Arrays = {"tokens": tokens.astype(np.uint32), "positions": kv.positions.copy()}
    dtypes: dict[str, str] = {}
    floor = 0
    for i in range(kv.num_layers):
        if i in kv.without_kv:
            continue
        keys, values, positions = kv.layer(i)
        if i in before_forgetting:
            keys, values, positions = _join(before_forgetting[i], (keys, values, positions), prompt_end)
        if windows[i]:
            missing = np.setdiff1d(kv.positions, positions)
            floor = max(floor, int(missing.max()) + windows[i] if len(missing) else 0)
        arrays[f"layer{i}.positions"] = positions.copy()
        if keys is not None:
            for name, a in (*_named(f"layer{i}.keys", keys), *_named(f"layer{i}.values", values)):
                arrays[name], dtypes[name] = as_bits(a)
    kept = sorted(p for p in states.snapshots if 0 < p < total) + [total] if kv.linear else []
    for p in kept:
        layers = states.layers if p == total else states.snapshots[p]
        for i, s in layers.items():
            for name, a in ((f"state{p}.layer{i}.state", s.state), (f"state{p}.layer{i}.halo", s.halo)):
                arrays[name], dtypes[name] = as_bits(a)
            arrays[f"state{p}.layer{i}.halo_real"] = s.halo_real.copy()
    mx.eval([a for a in arrays.values() if isinstance(a, mx.array)])
    return {"dtypes": dtypes, "floor": floor, "state_positions": kept, "quantized": kv.quantized}, arrays


def restore(shards: Sequence[tuple[dict, dict[str, np.ndarray]]], tokens: int, num_layers: int,
            linear: frozenset[int], mine: Callable[[np.ndarray], np.ndarray], kv_format: KVFormat,
            elsewhere: frozenset[int] = frozenset()) -> tuple[KVShard, StateStore]:
    """The KV shard and states of a saved prefix cut to `tokens`, keeping the positions `mine` selects
    from each saved shard (all of one's own; a ring of another size: a prefill's share), of the layers
    this rank runs (not `elsewhere`). A shard saved by pipeline stages comes as several files, each
    with its stage's layers."""
    kv = KVShard(num_layers, linear, kv_format, elsewhere)
    quantized = bool(shards[0][0]["quantized"])
    layers = {}
    for i in range(num_layers):
        if i in linear or i in elsewhere:
            continue
        parts = []
        for header, arrays in shards:
            if f"layer{i}.positions" not in arrays:  # another stage's file
                continue
            p = arrays[f"layer{i}.positions"]
            keep = (p < tokens) & mine(p)
            if keep.all():  # no copy but the one into MLX
                keep = slice(None)
            elif not keep.any():
                continue
            parts.append((p[keep], *(_kv(header, arrays, f"layer{i}.{name}", keep, quantized, kv_format)
                                     for name in ("keys", "values"))))
        if len(parts) == 1 and np.all(np.diff(parts[0][0]) > 0):
            positions, keys, values = parts[0]
            layers[i] = (keys, values, positions)
        elif parts:
            positions = np.concatenate([p for p, _, _ in parts])
            order = np.argsort(positions, kind="stable")
            index = mx.array(order)
            layers[i] = (take(concatenate([k for _, k, _ in parts], axis=2), index, axis=2),
                         take(concatenate([v for _, _, v in parts], axis=2), index, axis=2), positions[order])
    owned = np.concatenate([p[(p < tokens) & mine(p)] for p in (a["positions"] for _, a in shards)])
    kv.fill(np.unique(owned), layers, quantized)  # a shard's files (stages) hold the same positions
    store = StateStore()
    if linear:
        at = f"state{tokens}.layer"
        held = {i: next((h, a) for h, a in shards if f"{at}{i}.state" in a) for i in linear}
        layers_at = {i: LayerState(from_bits(header, f"{at}{i}.state", arrays[f"{at}{i}.state"]),
                                   from_bits(header, f"{at}{i}.halo", arrays[f"{at}{i}.halo"]),
                                   arrays[f"{at}{i}.halo_real"].copy())
                     for i, (header, arrays) in sorted(held.items())}
        store.layers = dict(layers_at)
        store.snapshots[tokens] = dict(layers_at)
    return kv, store


def _join(before: tuple[mx.array, mx.array, np.ndarray], now: tuple[mx.array, mx.array, np.ndarray],
          prompt_end: int) -> tuple[mx.array, mx.array, np.ndarray]:
    """A window layer's keys before it forgot old ones, then those it stored from `prompt_end` on."""
    k0, v0, p0 = before
    k1, v1, p1 = now
    later = np.flatnonzero(p1 >= prompt_end)
    if not len(later):
        return before
    index = mx.array(later)
    k1, v1 = mx.take(k1, index, axis=2), mx.take(v1, index, axis=2)
    if k0 is None:
        return k1, v1, p1[later]
    return mx.concatenate([k0, k1], axis=2), mx.concatenate([v0, v1], axis=2), np.concatenate([p0, p1[later]])


def _named(name: str, x: KV) -> list[tuple[str, mx.array]]:
    """The arrays of a layer's keys or values, under the names the file gives them."""
    if isinstance(x, Packed):
        return [(f"{name}.{part}", a) for part, a in zip(Packed.PARTS, x.arrays, strict=True)]
    return [(name, x)]


def _kv(header: dict, arrays: dict[str, np.ndarray], name: str, keep, quantized: bool, kv_format: KVFormat
        ) -> KV:
    """A layer's keys or values from the file, the tokens of `keep` (a mask or a slice)."""
    if quantized:
        parts = [f"{name}.{part}" for part in Packed.PARTS]
        return Packed(*(from_bits(header, n, arrays[n][:, :, keep]) for n in parts), kv_format.bits,
                      kv_format.group_size)
    return from_bits(header, name, arrays[name][:, :, keep])


def as_bits(a: mx.array) -> tuple[mx.array, str]:
    """An array numpy can hold, and the name of its dtype for the header: numpy has no bfloat16, so
    such arrays are kept as their bits."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, str(a.dtype).removeprefix("mlx.core.")


def from_bits(header: dict, name: str, bits: np.ndarray) -> mx.array:
    a = mx.array(np.ascontiguousarray(bits))
    dtype = DTYPES[header["dtypes"][name]][1]  # an unknown name: KeyError, the file does not fit
    return a.view(dtype) if a.dtype != dtype else a
