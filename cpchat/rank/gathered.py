"""Rank 0's copy of every rank's K/V, for a gather decode.

Where the ranks share one machine's cores and memory, the cheapest decode step exchanges nothing per
layer: while the answer's first token is sampled every other rank sends its shard to rank 0
(`send_shard`), which holds them with its own (`gather_shards`), the store one rank alone would have,
and runs each step as one rank does (one lazy graph a token, the next built while this one
evaluates). Each step's new keys and values go to the rank that keeps them (`pack_new`,
`unpack_new`), so the shards stay as every other decode leaves them; the copy is dropped with the
answer.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import KV, Packed, concatenate, quantize
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import kv_block, kv_from_block
from cpchat.rank.kvstore import KVShard
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey

NewKV = dict[int, tuple[mx.array, mx.array]]  # layer: the new token's keys and values [1, Hkv, 1, D]


def shard_key(request_id: str, layer: int) -> BlockKey:
    return BlockKey(request_id, layer, 0, pb.SHARD)


def new_kv_key(request_id: str, position: int) -> BlockKey:
    return BlockKey(request_id, 0, position % (1 << 32), pb.NEW_KV)


def attention_layers(kv: KVShard) -> list[int]:
    return [i for i in range(kv.num_layers) if i not in kv.linear]


def send_shard(kv: KVShard, ring: Ring, request_id: str) -> None:
    """This rank's keys, values and positions of each attention layer, to rank 0."""
    for layer in attention_layers(kv):
        k, v, positions = kv.layer(layer)
        ring.send(shard_key(request_id, layer), kv_block(mx.zeros((1, 1, 0, 1)), k, v, positions), to=0)


def gather_shards(kv: KVShard, ring: Ring, abort: threading.Event, request_id: str, tokens: int) -> KVShard:
    """Rank 0's own shard and every other rank's, as one store of `tokens` tokens (keys in rank order:
    positions, not places, say what a query sees)."""
    held = {}
    for layer in attention_layers(kv):
        parts = [kv.layer(layer)]
        for source in ring.peers:
            arrays, _ = ring.take(shard_key(request_id, layer), abort, source)
            parts.append(kv_from_block(arrays, kv.format) or (None, None, None))
        parts = [p for p in parts if p[0] is not None and len(p[2])]
        if not parts:
            continue
        held[layer] = (*(concatenate([_as_held(p[i], kv) for p in parts], axis=2) for i in (0, 1)),
                       np.concatenate([p[2] for p in parts]))
    copy = KVShard(kv.num_layers, kv.linear, kv.format)
    copy.fill(np.arange(tokens, dtype=np.int32), held, quantized=kv.quantized)
    return copy


def _as_held(x: KV, kv: KVShard) -> KV:
    """A shard sent before the step that turned the K/V quantized, quantized as rank 0's own was
    (per token: the same arrays, early or late)."""
    return quantize(x, kv.format) if kv.quantized and not isinstance(x, Packed) else x


def pack_new(new: NewKV) -> list[mx.array]:
    """A step's new keys and values, every layer's, as one flat tensor and their layout (a block may
    carry only a few tensors): per layer its index, then the keys' and the values' heads and sizes."""
    layers = sorted(new)
    flat = mx.concatenate([a.reshape(-1) for layer in layers for a in new[layer]])
    layout = [[layer, *new[layer][0].shape[1::2], *new[layer][1].shape[1::2]] for layer in layers]
    return [flat, mx.array(np.array(layout, np.int32).reshape(-1))]


def unpack_new(arrays: list[mx.array]) -> NewKV:
    flat, layout = arrays
    new, start = {}, 0
    for layer, k_heads, k_dim, v_heads, v_dim in np.asarray(layout).reshape(-1, 5).tolist():
        k = flat[start : start + k_heads * k_dim].reshape(1, k_heads, 1, k_dim)
        start += k_heads * k_dim
        v = flat[start : start + v_heads * v_dim].reshape(1, v_heads, 1, v_dim)
        start += v_heads * v_dim
        new[layer] = (k, v)
    return new
