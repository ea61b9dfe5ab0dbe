"""Rank 0's view of every rank's K/V, for a gather decode.

Where the ranks share one machine's cores and memory, the cheapest decode step exchanges nothing per
layer: while the answer's first token is sampled every other rank sends its shard to rank 0
(`send_shard`), which keeps the blocks as they arrive (`gather_shards`) and runs each step as one
rank does, attending over its own shard, those blocks and the answer's new tokens together
(`RingPass.attend_blocks`). Nothing is copied into one store: at 16K tokens that copy took a
quarter of a second an answer (fresh memory's pages). Each step's new keys and values go to the
rank that keeps them (`pack_new`, `unpack_new`); rank 0 keeps its own share in `Gathered.new`
until the answer ends (`hand_back`), so that the shard the steps read does not change under them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import packed, take
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import Block, kv_block, kv_from_block
from cpchat.rank.kvstore import KVShard
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey

NewKV = dict[int, tuple[mx.array, mx.array]]  # layer: a step's new keys and values [1, Hkv, n, D]


def shard_key(request_id: str, layer: int) -> BlockKey:
    return BlockKey(request_id, layer, 0, pb.SHARD)


def new_kv_key(request_id: str, position: int) -> BlockKey:
    return BlockKey(request_id, 0, position % (1 << 32), pb.NEW_KV)


def attention_layers(kv: KVShard) -> list[int]:
    return [i for i in range(kv.num_layers) if i not in kv.without_kv]


def send_shard(kv: KVShard, ring: Ring, request_id: str) -> None:
    """This rank's keys, values and positions of each attention layer, to rank 0."""
    for layer in attention_layers(kv):
        k, v, positions = kv.layer(layer)
        ring.send(shard_key(request_id, layer), kv_block(mx.zeros((1, 1, 0, 1)), k, v, positions), to=0)


class Gathered:
    """What rank 0 attends over in one answer's gather steps besides its own shard: the other ranks'
    blocks per attention layer (`others`), and the tokens the answer adds (`new`, every layer)."""

    def __init__(self, kv: KVShard, others: dict[int, list[Block]]) -> None:
        self.others = others
        self.new = KVShard(kv.num_layers, kv.linear, kv.format, kv.elsewhere)
        if kv.quantized:
            self.new.quantize()

    @property
    def quantized(self) -> bool:
        return self.new.quantized

    def blocks(self, kv: KVShard) -> dict[int, list[Block]]:
        """Per attention layer, the blocks a step reads besides the new tokens: rank 0's own shard's,
        then the others'."""
        return {layer: [kv.layer(layer), *self.others.get(layer, [])] for layer in attention_layers(kv)}

    def quantize(self) -> None:
        """Hold everything quantized, as rank 0's shard just turned (per token: the same arrays,
        early or late)."""
        self.new.quantize()
        self.others = {layer: [_as_held(block, self.new) for block in blocks]
                       for layer, blocks in self.others.items()}

    def hand_back(self, kv: KVShard, mine: Callable[[int], bool], below: int) -> None:
        """Rank 0's share of the answer's tokens (those `mine`, before `below`) into its shard."""
        positions = self.new.positions
        keep = np.array([p < below and mine(int(p)) for p in positions], dtype=bool)
        if not keep.any():
            return
        index = mx.array(np.flatnonzero(keep))
        kv.begin_append(positions[keep])
        for layer in attention_layers(kv):
            k, v, _ = self.new.layer(layer)
            kv.append(layer, take(k, index, axis=2), take(v, index, axis=2))
        kv.commit()


def gather_shards(kv: KVShard, ring: Ring, abort: threading.Event, request_id: str) -> Gathered:
    """Every other rank's shard, as `send_shard` sent it."""
    others: dict[int, list[Block]] = {}
    for layer in attention_layers(kv):
        for source in ring.peers:
            arrays, _ = ring.take(shard_key(request_id, layer), abort, source)
            block = kv_from_block(arrays, kv.format)
            if block is not None:
                others.setdefault(layer, []).append(_as_held(block, kv))
    return Gathered(kv, others)


def _as_held(block: Block, kv: KVShard) -> Block:
    """A block in the form `kv` holds its own: quantized if it is (a block sent before the step that
    turned the K/V quantized)."""
    if not kv.quantized:
        return block
    k, v, positions = block
    return packed(k, kv.format), packed(v, kv.format), positions


def pack_new(new: NewKV) -> list[mx.array]:
    """A step's new keys and values, every layer's, as one flat tensor and their layout (a block may
    carry only a few tensors): per layer its index, the tokens, then the keys' and the values' heads
    and sizes."""
    layers = sorted(new)
    flat = mx.concatenate([a.reshape(-1) for layer in layers for a in new[layer]])
    layout = [[layer, new[layer][0].shape[2], *new[layer][0].shape[1::2], *new[layer][1].shape[1::2]]
              for layer in layers]
    return [flat, mx.array(np.array(layout, np.int32).reshape(-1))]


def unpack_new(arrays: list[mx.array]) -> NewKV:
    flat, layout = arrays
    new, start = {}, 0
    for layer, tokens, k_heads, k_dim, v_heads, v_dim in np.asarray(layout).reshape(-1, 6).tolist():
        k = flat[start : start + k_heads * tokens * k_dim].reshape(1, k_heads, tokens, k_dim)
        start += k_heads * tokens * k_dim
        v = flat[start : start + v_heads * tokens * v_dim].reshape(1, v_heads, tokens, v_dim)
        start += v_heads * tokens * v_dim
        new[layer] = (k, v)
    return new
