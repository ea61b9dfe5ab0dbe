"""Context-parallel attention installed into an unmodified mlx-lm model.

The model runs its own forward on this rank's tokens, laid out as a batch of
rows (two head-tail chunks in prefill, one token in decode). Each layer gets a
`ShardCache`: its `offset` holds the rows' global start positions (RoPE takes
per-row offsets), `update_and_fetch` stores the real tokens in the `KVShard`,
and mlx-lm's `scaled_dot_product_attention`, as every model module binds it, is
replaced by `ring_attention`, which hands the queries to the running `RingPass`
(with the layer's sliding window and attention sinks, if it has them).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from cpchat.core.attention import add_sink, merge_partials, partial_attention
from cpchat.core.sharding import head_split
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.fit import AttentionCall, UnsupportedModel
from cpchat.rank.kvstore import KVShard
from cpchat.rank.ring import Ring
from cpchat.rank.statestore import StateStore
from cpchat.rank.wire import BlockKey, block_nbytes


@dataclass
class StepTiming:
    layer: int
    step: int
    compute_ms: float = 0.0
    wait_ms: float = 0.0
    bytes_sent: int = 0


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
    mode: str  # "pass_kv" | "pass_q" | "all_gather" | "ulysses" (prefill), "decode_exchange" | "decode_ring"
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
    timings: list[StepTiming] = field(default_factory=list)
    calls: list[AttentionCall] = field(default_factory=list)  # what each layer asked of attention
    recurrences: list[tuple[int, str]] = field(default_factory=list)  # what each linear layer ran

    @property
    def decoding(self) -> bool:
        """Every rank runs the same one token (decode), rather than its own rows of the prompt."""
        return self.mode.startswith("decode")

    @property
    def chunk(self) -> int:
        return len(self.q_positions) // 2  # prefill: two rows, a head and a tail chunk

    # ---- the two hooks the model calls

    def store_new(self, layer: int, keys: mx.array, values: mx.array) -> None:
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
        q = _flatten_rows(queries)
        k, v, k_pos = self.kv.layer(layer)
        if self.ring.size > 1:  # blocks must be concrete before they travel
            mx.eval(q, *(a for a in (k, v) if a is not None))
        run = {
            "pass_kv": self._pass_kv, "pass_q": self._pass_q, "all_gather": self._all_gather,
            "ulysses": self._ulysses, "decode_exchange": self._exchange_partials,
            "decode_ring": self._ring_partials,
        }[self.mode]
        out, lse = run(call, q, k, v, k_pos)
        if sinks is not None:
            out = add_sink(out, lse, sinks)
        if self.on_layer is not None:
            self.on_layer(layer)
        out = out.astype(queries.dtype)
        return out.reshape(heads, rows, chunk, out.shape[-1]).transpose(1, 0, 2, 3)

    # ---- algorithms

    def _timed_local(self, call: LayerCall, timing: StepTiming, q, q_pos, k, v, k_pos):
        if k is None or len(k_pos) == 0:
            return _empty_partial(q, call.value_dim)
        if self.ring.size == 1:  # nothing to overlap or report: stay lazy, one graph per forward
            return partial_attention(q, k, v, q_pos, k_pos, call.scale, window=call.window)
        t0 = time.perf_counter()
        out, lse = partial_attention(q, k, v, q_pos, k_pos, call.scale, window=call.window)
        mx.eval(out, lse)
        timing.compute_ms += 1000 * (time.perf_counter() - t0)
        return out, lse

    def _key(self, layer: int, step: int, kind: int) -> BlockKey:
        if self.decoding:  # consecutive tokens' partials differ: a rank may run one token ahead
            step += self.start % 2 * self.ring.size
        return BlockKey(self.request_id, layer, step, kind)

    def _take(self, timing: StepTiming, key: BlockKey, source: int | None = None) -> list[mx.array]:
        tensors, waited = self.ring.take(key, self.abort, source)
        timing.wait_ms += 1000 * waited
        return tensors

    def _send(self, timing: StepTiming, key: BlockKey, tensors: list[mx.array], to: list[int] | None = None
              ) -> None:
        """To the next rank, or to each rank of `to`."""
        to = [self.ring.next_rank] if to is None else to
        self.ring.send_all(key, tensors, to)
        timing.bytes_sent += block_nbytes(tensors) * len(to)

    def step_timing(self, layer: int, step: int) -> StepTiming:
        timing = StepTiming(layer, step)
        self.timings.append(timing)
        return timing

    def _pass_kv(self, call: LayerCall, q, k, v, k_pos):
        """Queries stay; every rank's K/V block visits every rank (N-1 hops).
        The block is forwarded before it is used, so the send overlaps compute."""
        n, layer = self.ring.size, call.layer
        parts = []
        block = None if k is None else [k, v, mx.array(k_pos)]
        for step in range(n):
            timing = self.step_timing(layer, step)
            if step > 0:
                block = self._take(timing, self._key(layer, step - 1, pb.KV))
                block = None if block[2].size == 0 else block
            if step < n - 1:
                self._send(timing, self._key(layer, step, pb.KV), block or _empty_kv(q))
            if block is not None:
                bk, bv, bpos = block
                parts.append(self._timed_local(call, timing, q, self.q_positions, bk, bv, np.asarray(bpos)))
        return merge_partials(parts) if parts else _empty_partial(q, call.value_dim)

    def _pass_q(self, call: LayerCall, q, k, v, k_pos):
        """K/V stay; each rank's queries travel a full lap carrying their running
        (out, lse), merging one partial per rank, and come home (N hops)."""
        n, layer = self.ring.size, call.layer
        timing = self.step_timing(layer, 0)
        out, lse = self._timed_local(call, timing, q, self.q_positions, k, v, k_pos)
        if n == 1:
            return out, lse
        q_pos = mx.array(self.q_positions)
        self._send(timing, self._key(layer, 0, pb.QUERY), [q, q_pos, out, lse])
        for step in range(1, n + 1):
            timing = self.step_timing(layer, step)
            vq, vq_pos, vout, vlse = self._take(timing, self._key(layer, step - 1, pb.QUERY))
            if step == n:
                return vout, vlse  # our own queries, home with every rank's partial merged
            mine = self._timed_local(call, timing, vq, np.asarray(vq_pos), k, v, k_pos)
            vout, vlse = merge_partials([(vout, vlse), mine])
            self._send(timing, self._key(layer, step, pb.QUERY), [vq, vq_pos, vout, vlse])
        raise AssertionError("unreachable")

    def _all_gather(self, call: LayerCall, q, k, v, k_pos):
        """Queries stay; every rank sends its K/V to every other rank at once, attends to its own
        block while the others arrive, then to all of theirs in one pass. The others' K/V is
        dropped when the layer ends: the store stays 1/N of the sequence."""
        layer, key = call.layer, self._key(call.layer, 0, pb.GATHER)
        timing = self.step_timing(layer, 0)
        self._send(timing, key, _kv_block(q, k, v, k_pos), to=self.ring.peers)
        parts = [self._timed_local(call, timing, q, self.q_positions, k, v, k_pos)]
        timing = self.step_timing(layer, 1)
        blocks = [self._take(timing, key, source) for source in self.ring.peers]
        blocks = [b for b in blocks if b[2].size]
        if blocks:
            gk, gv = (mx.concatenate([b[i] for b in blocks], axis=2) for i in (0, 1))
            g_pos = np.concatenate([np.asarray(b[2]) for b in blocks])
            parts.append(self._timed_local(call, timing, q, self.q_positions, gk, gv, g_pos))
        return merge_partials(parts)

    def _ulysses(self, call: LayerCall, q, k, v, k_pos):
        """All-to-all from "every head, this rank's tokens" to "every token, this rank's heads":
        each rank attends its share of the query heads over the whole sequence (cached keys
        included) in one pass, and a second all-to-all brings each output home. Query heads are
        split as evenly as N allows (`head_split`); a key head whose query heads fall on two
        ranks goes to both."""
        n, me, layer = self.ring.size, self.ring.rank, call.layer
        shares = head_split(q.shape[1], call.kv_heads, n)
        timing = self.step_timing(layer, 0)
        q_pos = mx.array(self.q_positions)
        kv = _kv_block(q, k, v, k_pos)
        for rank, share in enumerate(shares):
            block = [q[:, share.start:share.stop], q_pos, *_select_heads(kv, share.kv_index)]
            if rank == me:
                own = block
            elif share.stop > share.start:
                self._send(timing, self._key(layer, 0, pb.HEADS), block, to=[rank])
        home = {}
        if shares[me].stop > shares[me].start:  # with more ranks than query heads, some have none
            timing = self.step_timing(layer, 1)
            heads_key = self._key(layer, 0, pb.HEADS)
            blocks = [own if r == me else self._take(timing, heads_key, r) for r in range(n)]
            gq = mx.concatenate([b[0] for b in blocks], axis=2)
            gq_pos = np.concatenate([np.asarray(b[1]) for b in blocks])
            with_keys = [b for b in blocks if b[4].size]
            gk, gv = (mx.concatenate([b[i] for b in with_keys], axis=2) for i in (2, 3))
            gk_pos = np.concatenate([np.asarray(b[4]) for b in with_keys])
            out, lse = self._timed_local(call, timing, gq, gq_pos, gk, gv, gk_pos)
            bounds = np.cumsum([0, *(b[0].shape[2] for b in blocks)]).tolist()
            home = {r: [a[:, :, bounds[r]:bounds[r + 1]] for a in (out, lse)] for r in range(n)}
            for r in self.ring.peers:
                self._send(timing, self._key(layer, 0, pb.OUTPUT), home[r], to=[r])
        timing = self.step_timing(layer, 2)
        parts = [home[me] if r == me else self._take(timing, self._key(layer, 0, pb.OUTPUT), r)
                 for r, share in enumerate(shares) if share.stop > share.start]
        return mx.concatenate([o for o, _ in parts], axis=1), mx.concatenate([s for _, s in parts], axis=1)

    def _exchange_partials(self, call: LayerCall, q, k, v, k_pos):
        """Decode in one exchange: every rank holds the same query, sends its partial output to
        every other rank at once, and merges all N in rank order, so all ranks agree bit for bit."""
        layer, key = call.layer, self._key(call.layer, 0, pb.PARTIAL)
        timing = self.step_timing(layer, 0)
        mine = self._timed_local(call, timing, q, self.q_positions, k, v, k_pos)
        if self.ring.size == 1:
            return mine
        self._send(timing, key, list(mine), to=self.ring.peers)
        timing = self.step_timing(layer, 1)
        parts = [mine if r == self.ring.rank else tuple(self._take(timing, key, r))
                 for r in range(self.ring.size)]
        return merge_partials(parts)

    def _ring_partials(self, call: LayerCall, q, k, v, k_pos):
        """Decode over the ring: every rank holds the same query; partial outputs go around the
        ring (N-1 hops) and are merged in rank order, so all ranks agree bit for bit."""
        n, layer = self.ring.size, call.layer
        timing = self.step_timing(layer, 0)
        parts = {self.ring.rank: self._timed_local(call, timing, q, self.q_positions, k, v, k_pos)}
        block = list(parts[self.ring.rank])
        for step in range(n - 1):
            self._send(timing, self._key(layer, step, pb.PARTIAL), block)
            timing = self.step_timing(layer, step + 1)
            block = self._take(timing, self._key(layer, step, pb.PARTIAL))
            parts[(self.ring.rank - step - 1) % n] = tuple(block)
        return merge_partials([parts[r] for r in range(n)])


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


def _empty_partial(q: mx.array, value_dim: int) -> tuple[mx.array, mx.array]:
    return mx.zeros((*q.shape[:-1], value_dim), mx.float32), mx.full(q.shape[:-1], float("-inf"))


def _empty_kv(q: mx.array) -> list[mx.array]:
    shape = (1, 1, 0, q.shape[-1])
    return [mx.zeros(shape, q.dtype), mx.zeros(shape, q.dtype), mx.zeros((0,), mx.int32)]


def _kv_block(q: mx.array, k: mx.array | None, v: mx.array | None, k_pos: np.ndarray) -> list[mx.array]:
    """This rank's keys, values and key positions as a block that can travel (empty if it holds none)."""
    if k is None or len(k_pos) == 0:
        return _empty_kv(q)
    return [k, v, mx.array(k_pos)]


def _select_heads(kv: list[mx.array], index: range | list[int]) -> list[mx.array]:
    k, v, k_pos = kv
    if k.shape[2] == 0:
        return kv
    if isinstance(index, range):
        return [k[:, index.start:index.stop], v[:, index.start:index.stop], k_pos]
    index = mx.array(index)
    return [mx.take(k, index, axis=1), mx.take(v, index, axis=1), k_pos]
