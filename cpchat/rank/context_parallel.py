"""Context-parallel attention installed into an unmodified mlx-lm model.

The model runs its own forward on this rank's tokens, laid out as a batch of
rows (two head-tail chunks in prefill, one token in decode). Each layer gets a
`ShardCache`: its `offset` holds the rows' global start positions (RoPE takes
per-row offsets), `update_and_fetch` stores the real tokens in the `KVShard`,
and mlx-lm's `scaled_dot_product_attention`, as every model module binds it, is
replaced by `ring_attention`, which hands the queries to the running `RingPass`
(with the layer's sliding window and attention sinks, if it has them). The pass
runs the algorithm the request names: one function in cpchat.rank.algorithms,
which crosses the ring with what `RingPass` gives it (its ring, its block keys,
its timed partial attention).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from cpchat.core.algorithms import BY_NAME
from cpchat.core.attention import (
    add_sink,
    attention_over_blocks,
    fused_attention,
    merge_partials,
    partial_attention,
)
from cpchat.core.quantized_kv import KV, KVFormat, Packed, arrays_of, full_precision
from cpchat.core.sharding import Shares
from cpchat.rank.fit import AttentionCall, UnsupportedModel
from cpchat.rank.kvstore import KVShard
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey, block_nbytes

# One rank's decode step stays one lazy MLX graph per token, as mlx-lm's does, while its attention
# is short; numpy's attention forces an evaluation per layer but its exp is faster, and wins past
# about 64K scores a layer (query heads x queries x keys; measured on a 1024-wide llama: 4K keys, 16 heads).
LAZY_DECODE_SCORES = 1 << 16

Partial = tuple[mx.array, mx.array]  # (out [1, H, L, Dv] float32, lse [1, H, L]): cpchat.core.attention
# How a layer's attention crosses the ring (cpchat.rank.algorithms): (rp, call, q, k, v, k_pos) -> Partial
Attend = Callable[["RingPass", "LayerCall", mx.array, "KV | None", "KV | None", np.ndarray], Partial]
Block = tuple[KV, KV, np.ndarray]  # keys [1, Hkv, n, D], values and their n positions


@dataclass
class StepTiming:
    layer: int
    step: int
    compute_ms: float = 0.0
    wait_ms: float = 0.0
    bytes_sent: int = 0


@dataclass
class StepMeans:
    """A decode answer's ring steps so far, each (layer, step)'s mean over its tokens: one token's
    sub-millisecond waits are mostly this machine's noise."""

    sums: dict[tuple[int, int], StepTiming] = field(default_factory=dict)
    tokens: int = 0

    def add(self, timings: list[StepTiming]) -> list[StepTiming]:
        """Count one more token's steps; the means now."""
        self.tokens += 1
        for t in timings:
            total = self.sums.setdefault((t.layer, t.step), StepTiming(t.layer, t.step))
            total.compute_ms += t.compute_ms
            total.wait_ms += t.wait_ms
            total.bytes_sent += t.bytes_sent
        n = self.tokens
        return [StepTiming(t.layer, t.step, t.compute_ms / n, t.wait_ms / n, t.bytes_sent // n)
                for t in self.sums.values()]


@dataclass(frozen=True)
class LayerCall:
    """One layer's attention call, as the ring algorithms need it."""

    layer: int
    scale: float
    window: int | None
    kv_heads: int
    value_dim: int


@dataclass
class RingPass:
    """One forward of the model over this rank's rows, and how attention crosses the ring."""

    request_id: str
    algorithm: str  # a name in cpchat.core.algorithms.REGISTRY: a prefill's ("pass_kv", ...) or a decode's
    ring: Ring
    kv: KVShard
    row_offsets: mx.array | int
    q_positions: np.ndarray  # flattened row positions, padding included
    real: np.ndarray  # which flattened positions are real tokens
    store: bool  # whether this rank keeps the new tokens' K/V
    abort: threading.Event
    windows: list[int | None]  # per layer: the sliding window, or None for full causal attention
    on_layer: object = None  # callable(layer) for progress
    linear: frozenset[int] = frozenset()  # layers with a recurrent state (cpchat.rank.linear_layers)
    states: StateStore | None = None  # their states and halos (every rank holds them all)
    start: int = 0  # global position of the first new token
    seq_len: int = 0  # new tokens in this forward (all ranks' together, in prefill)
    shares: Shares | None = None  # each rank's share of them (cpchat.core.sharding; None: equal)
    keeper: int = 0  # decode: the rank that keeps the new tokens' K/V
    tick: int | None = None  # decode: the answer's step (its parity tells steps apart); None: start
    hand_on: bool = False  # a gather step (rank 0 alone, on every rank's K/V): new K/V kept for the keeper
    held: dict[int, list[Block]] = field(default_factory=dict)  # a gather step's blocks besides `kv`'s
    timings: list[StepTiming] = field(default_factory=list)
    calls: list[AttentionCall] = field(default_factory=list)  # what each layer asked of attention
    layer_calls: dict[int, LayerCall] = field(default_factory=dict)  # the same, as the algorithms take it
    unkept: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)  # new K/V another rank keeps
    recurrences: list[tuple[int, str]] = field(default_factory=list)  # what each linear layer ran
    crossing: Attend = field(kw_only=True)  # the algorithm's function (cpchat.rank.algorithms.ATTEND)

    @property
    def decoding(self) -> bool:
        """Every rank runs the same one token (decode), rather than its own rows of the prompt."""
        return BY_NAME[self.algorithm].stage == "decode"

    # ---- the two hooks the model calls

    def store_new(self, layer: int, keys: mx.array, values: mx.array) -> None:
        if not self.store or self.hand_on:
            self.unkept[layer] = (keys, values)  # a lead or gather step sends them to their keeper
        if not self.store:
            return
        k, v = _flatten_rows(keys), _flatten_rows(values)
        if not self.real.all():
            index = mx.array(np.flatnonzero(self.real))
            k, v = mx.take(k, index, axis=2), mx.take(v, index, axis=2)
        if k.shape[2]:
            self.kv.append(layer, k, v)

    def attend(self, layer: int, queries: mx.array, values: mx.array, scale: float,
               sinks: mx.array | None, mask: object) -> mx.array:
        """Attention of this rank's queries over every rank's keys; `values` are the new tokens'."""
        rows, heads, chunk, _ = queries.shape
        if isinstance(mask, mx.array):  # ShardCache makes no masks: this one carries the model's own scores
            raise UnsupportedModel(f"layer {layer} passes attention a mask of its own (extra scores, as "
                                   "MLA's RoPE scores), which the ring cannot apply across ranks")
        self.calls.append(AttentionCall(layer, heads, sinks is not None))
        call = LayerCall(layer, scale, self.windows[layer], values.shape[1], values.shape[-1])
        self.layer_calls[layer] = call
        q = _flatten_rows(queries)
        k, v, k_pos = self.kv.layer(layer)
        if self.ring.size > 1:  # blocks must be concrete before they travel
            mx.eval(q, *(arrays_of(x) for x in (k, v) if x is not None))
        if self.ring.size == 1 and not self.held and k is not None and mx.default_device() != mx.cpu:
            out = fused_attention(q, full_precision(k), full_precision(v), self.q_positions, k_pos, scale,
                                  call.window, sinks)
        else:
            out, lse = self.crossing(self, call, q, k, v, k_pos)
            if sinks is not None:
                out = add_sink(out, lse, sinks)
        if self.on_layer is not None:
            self.on_layer(layer)
        out = out.astype(queries.dtype)
        return out.reshape(heads, rows, chunk, out.shape[-1]).transpose(1, 0, 2, 3)

    # ---- what the algorithms use

    def partial(self, call: LayerCall, timing: StepTiming, q: mx.array, q_pos: np.ndarray,
                k: KV | None, v: KV | None, k_pos: np.ndarray) -> Partial:
        """Attention of `q` over one block of keys (cpchat.core.attention), its time in `timing`.
        Quantized keys and values are dequantized first (the block's, then dropped)."""
        if self.ring.size == 1:  # nothing to overlap or report
            return self.attend_blocks(call, q, q_pos, [(k, v, k_pos)])
        if k is None or len(k_pos) == 0:
            return empty_partial(q, call.value_dim)
        t0 = time.perf_counter()
        out, lse = partial_attention(q, full_precision(k), full_precision(v), q_pos, k_pos, call.scale,
                                     window=call.window)
        mx.eval(out, lse)
        timing.compute_ms += 1000 * (time.perf_counter() - t0)
        return out, lse

    def attend_blocks(self, call: LayerCall, q: mx.array, q_pos: np.ndarray, blocks: list[Block]) -> Partial:
        """A rank alone's attention of `q` over blocks of keys (its shard's, and in a gather step the
        other ranks'): a decode step's over several blocks stays one lazy graph while its scores are
        few, as mlx-lm's does; over its own shard, every score at once (core.attention._one_query)."""
        blocks = [(full_precision(k), full_precision(v), p) for k, v, p in blocks if k is not None and len(p)]
        if not blocks:
            return empty_partial(q, call.value_dim)
        scores = q.shape[1] * q.shape[2] * sum(len(p) for *_, p in blocks)
        if len(blocks) > 1 and self.decoding and scores <= LAZY_DECODE_SCORES:
            return attention_over_blocks(q, blocks, q_pos, call.scale, call.window)
        return merge_partials([partial_attention(q, k, v, q_pos, p, call.scale, window=call.window)
                               for k, v, p in blocks])

    def key(self, layer: int, step: int, kind: int) -> BlockKey:
        """The key of a block of this pass (`kind` a pb.FrameKind)."""
        if self.decoding:  # consecutive steps' partials differ: a rank may run one step ahead
            step += (self.start if self.tick is None else self.tick) % 2 * self.ring.size
        return BlockKey(self.request_id, layer, step, kind)

    def take(self, timing: StepTiming, key: BlockKey, source: int | None = None) -> list[mx.array]:
        """The block of `key` from `source` (the previous rank if None), the wait in `timing`."""
        tensors, waited = self.ring.take(key, self.abort, source)
        timing.wait_ms += 1000 * waited
        return tensors

    def take_kv(self, timing: StepTiming, key: BlockKey, source: int | None = None
                ) -> tuple[KV, KV, np.ndarray] | None:
        """A K/V block, as `kv_block` sent it: None if it holds no keys."""
        return self.read_kv(self.take(timing, key, source))

    def read_kv(self, arrays: list[mx.array]) -> tuple[KV, KV, np.ndarray] | None:
        return kv_from_block(arrays, self.kv.format)

    def send(self, timing: StepTiming, key: BlockKey, tensors: list[mx.array], to: list[int] | None = None
             ) -> None:
        """To the next rank, or to each rank of `to`."""
        to = [self.ring.next_rank] if to is None else to
        self.ring.send_all(key, tensors, to)
        timing.bytes_sent += block_nbytes(tensors) * len(to)

    def step_timing(self, layer: int, step: int) -> StepTiming:
        timing = StepTiming(layer, step)
        self.timings.append(timing)
        return timing


class ShardCache:
    """The per-layer cache object mlx-lm's attention sees."""

    def __init__(self, ring_pass: RingPass, layer: int) -> None:
        self.ring_pass, self.layer = ring_pass, layer

    @property
    def offset(self) -> mx.array | int:
        return self.ring_pass.row_offsets

    def make_mask(self, *args, **kwargs) -> None:
        return None  # masks come from global positions inside the ring pass

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.ring_pass.store_new(self.layer, keys, values)
        return keys, values


def ring_attention(original):
    """A drop-in for mlx_lm.models.base.scaled_dot_product_attention."""

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, ShardCache):
            return cache.ring_pass.attend(cache.layer, queries, values, scale, sinks, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.__wrapped__ = original
    return attention


def install() -> None:
    """Route attention through the ring in every loaded mlx-lm model module that calls mlx-lm's
    scaled_dot_product_attention (a model may use another family's attention class). Idempotent,
    and a module's own attention runs unchanged for any cache but a ShardCache."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not base \
                and getattr(module, "scaled_dot_product_attention", None) is original:
            module.scaled_dot_product_attention = ring_attention(original)


def _flatten_rows(x: mx.array) -> mx.array:
    """[R, H, C, D] -> [1, H, R*C, D], row 0 first."""
    rows, heads, chunk, dim = x.shape
    if rows == 1:
        return x
    return x.transpose(1, 0, 2, 3).reshape(1, heads, rows * chunk, dim)


def empty_partial(q: mx.array, value_dim: int) -> Partial:
    """What attention over no key gives: out = 0, lse = -inf."""
    return mx.zeros((*q.shape[:-1], value_dim), mx.float32), mx.full(q.shape[:-1], float("-inf"))


def kv_block(q: mx.array, k: KV | None, v: KV | None, k_pos: np.ndarray) -> list[mx.array]:
    """Keys, values and key positions as arrays that can travel: [k, v, positions], or quantized
    [k words, scales, biases, v words, scales, biases, positions]; a block of no keys where none."""
    if k is None or len(k_pos) == 0:
        shape = (1, 1, 0, q.shape[-1])
        return [mx.zeros(shape, q.dtype), mx.zeros(shape, q.dtype), mx.zeros((0,), mx.int32)]
    return [*arrays_of(k), *arrays_of(v), mx.array(k_pos)]


def kv_from_block(arrays: list[mx.array], fmt: KVFormat) -> tuple[KV, KV, np.ndarray] | None:
    """What `kv_block` made, back: None for a block of no keys."""
    positions = np.asarray(arrays[-1])
    if positions.size == 0:
        return None
    if len(arrays) == 3:
        return arrays[0], arrays[1], positions
    k, v = (Packed(*arrays[i:i + 3], fmt.bits, fmt.group_size) for i in (0, 3))
    return k, v, positions
