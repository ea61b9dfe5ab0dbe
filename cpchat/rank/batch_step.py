"""A decode step over several conversations at once (`Step`): row b of the batch is conversation b's
unread token, at that conversation's own next position.

The model's own __call__ runs on the B rows, so its weight products read the weights once for the
batch (where a memory-bound decode gains). Each row attends over its own conversation's keys on every
rank, and one exchange a layer carries the batch's partials, merged in rank order on every rank as an
exchange step's are (cpchat.rank.algorithms.decode). One rank keeps each row's new K/V (round robin by
position, in the row's shares); linear layers run each row from its conversation's state, on every
rank. The rank that samples shares the batch's tokens with the others at the end, so every rank
knows each conversation's unread token as after a Generate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from cpchat.core.attention import add_sink, merge_partials, partial_attention
from cpchat.core.quantized_kv import full_precision
from cpchat.core.sharding import decode_owner
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.algorithms.decode import packed, unpacked
from cpchat.rank.context_parallel import Partial, ShardCache, empty_partial
from cpchat.rank.engine import BadRequest, check_shares
from cpchat.rank.fit import UnsupportedModel
from cpchat.rank.kvstore import KVShard
from cpchat.rank.linear_layers import Recurrence, StateCache, decode_halo_rows, decode_recurrence
from cpchat.rank.model_load import ModelShape
from cpchat.rank.sampling import sample, token_event
from cpchat.rank.sequences import Parked, Sequence
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey


class Holds(Protocol):
    """What a batched step reads of the engine."""

    model: object
    info: ModelShape | None
    parked: Parked

    def new_kv(self) -> KVShard: ...


@dataclass
class Row:
    """One conversation's place in the step."""

    sequence: Sequence
    token: int
    keeper: int  # the rank that keeps this row's new K/V

    @property
    def position(self) -> int:
        return self.sequence.total_tokens


def check(engine: Holds, req: pb.StepRequest, ranks: int) -> None:
    """Refuse a step this rank cannot run in a ring of `ranks`, before it takes the rank."""
    if engine.model is None:
        raise BadRequest("no model is loaded")
    info = engine.info
    if info.place.stages > 1:
        raise BadRequest("a batched decode step runs one pipeline stage; stages run a request at a time")
    if not req.rows:
        raise BadRequest("the step has no rows")
    names = [row.sequence for row in req.rows]
    if len(set(names)) < len(names):
        raise BadRequest("a conversation is in the step twice")
    for row in req.rows:
        held = engine.parked.find(engine, row.sequence)
        if held is None or held.unread is None:
            raise BadRequest(f"conversation {row.sequence!r} has no unread token here: a Generate starts it")
        if held.unread != (held.total_tokens, row.token):
            raise BadRequest(f"conversation {row.sequence!r} reads token {held.unread[1]} next, "
                             f"not {row.token}")
        check_shares(row.shares, ranks)


def run(engine: Holds, req: pb.StepRequest, ring: Ring, abort: threading.Event) -> list[pb.TokenEvent]:
    """The step (every rank together): the sampled tokens on rank 0, none on the others. On failure
    every conversation is as before it."""
    sequences = engine.parked.side_by_side(engine, [row.sequence for row in req.rows], engine.new_kv)
    rows = [Row(s, r.token, decode_owner(s.total_tokens, ring.size, tuple(r.shares) or None))
            for s, r in zip(sequences, req.rows)]
    fmt = engine.info.kv_format
    for row in rows:
        if fmt.quantized and not row.sequence.kv.quantized and row.position >= max(fmt.start, 1):
            row.sequence.kv.quantize()  # mlx-lm's check before a call that reads from this position
        if row.keeper == ring.rank:
            row.sequence.kv.begin_append(np.array([row.position]))
    batch = BatchPass(req.step_id, ring, abort, rows, [layer.window for layer in engine.info.layers])
    states = [dict(row.sequence.states.layers) for row in rows]
    try:
        caches = [BatchStateCache(batch, i) if i in engine.info.linear else BatchCache(batch, i)
                  for i in range(engine.info.num_layers)]
        logits = engine.model(mx.array([[row.token] for row in rows]), cache=caches)[:, 0]
        mx.eval(logits)
        for row in rows:
            if row.keeper == ring.rank:
                row.sequence.kv.commit()
        events = _sample_and_share(req, ring, abort, logits)
    except BaseException:
        for row, before in zip(rows, states):
            row.sequence.kv.truncate(row.position)
            row.sequence.states.layers = before
        raise
    finally:
        ring.mailbox.forget(req.step_id)
    for row, event in zip(rows, events):
        s = row.sequence
        s.tokens = np.append(s.tokens, np.uint32(row.token))
        s.total_tokens += 1
        s.unread = (s.total_tokens, event.id)
    return events if ring.rank == 0 else []


def _sample_and_share(req: pb.StepRequest, ring: Ring, abort: threading.Event,
                      logits: mx.array) -> list[pb.TokenEvent]:
    """Rank 0 samples each row's token and sends the batch's to the others."""
    key = BlockKey(req.step_id, 0, 0, pb.TOKEN)
    if ring.rank:
        (ids,), _ = ring.take(key, abort, 0)
        return [pb.TokenEvent(id=int(i)) for i in np.asarray(ids)]
    events = []
    for b, row in enumerate(req.rows):
        sampled = sample(logits[b], row.sampling, row.index)
        mx.eval(sampled)
        events.append(token_event(sampled))
    if ring.size > 1:
        ring.send_all(key, [mx.array([e.id for e in events], mx.uint32)], ring.peers)
    return events


class BatchPass:
    """The step's forward on this rank: the hooks mlx-lm's attention calls, a row per conversation."""

    def __init__(self, step_id: str, ring: Ring, abort: threading.Event, rows: list[Row],
                 windows: list[int | None]) -> None:
        self.step_id, self.ring, self.abort, self.rows, self.windows = step_id, ring, abort, rows, windows
        self.offsets = mx.array([row.position for row in rows])

    def store_new(self, layer: int, keys: mx.array, values: mx.array) -> None:
        for b, row in enumerate(self.rows):
            if row.keeper == self.ring.rank:
                row.sequence.kv.append(layer, keys[b:b + 1], values[b:b + 1])

    def attend(self, layer: int, queries: mx.array, values: mx.array, scale: float,
               sinks: mx.array | None, mask: object) -> mx.array:
        """Row b's query over conversation b's keys on every rank: [B, H, 1, Dv]."""
        if isinstance(mask, mx.array):
            raise UnsupportedModel(f"layer {layer} passes attention a mask of its own, which a batched "
                                   "step cannot apply")
        parts = [self._row_partial(layer, queries[b:b + 1], row, scale, values.shape[-1])
                 for b, row in enumerate(self.rows)]
        out, lse = mx.concatenate([o for o, _ in parts]), mx.concatenate([s for _, s in parts])
        if self.ring.size > 1:
            out, lse = self._exchange(layer, (out, lse))
        if sinks is not None:
            out = add_sink(out, lse, sinks)
        return out.astype(queries.dtype)

    def _row_partial(self, layer: int, q: mx.array, row: Row, scale: float, value_dim: int) -> Partial:
        k, v, k_pos = row.sequence.kv.layer(layer)
        if k is None or len(k_pos) == 0:
            return empty_partial(q, value_dim)
        k, v, window, q_pos = full_precision(k), full_precision(v), self.windows[layer], [row.position]
        return partial_attention(q, k, v, q_pos, k_pos, scale, window=window)

    def _exchange(self, layer: int, mine: Partial) -> Partial:
        """Every rank's partials for the batch, merged in rank order."""
        key, ring = BlockKey(self.step_id, layer, 0, pb.PARTIAL), self.ring
        mx.eval(*mine)
        ring.send_all(key, [packed(mine)], ring.peers)
        return merge_partials([mine if r == ring.rank else unpacked(ring.take(key, self.abort, r)[0])
                               for r in range(ring.size)])


class BatchCache(ShardCache):
    """The per-layer cache object mlx-lm's attention sees in a batched step: each row at its own offset."""

    @property
    def offset(self) -> mx.array:
        return self.ring_pass.offsets


class BatchStateCache(StateCache):
    """The cache object a linear layer sees in a batched step: row b continues conversation b's state
    and halo (every rank advances them all, as in a decode step)."""

    def halo_rows(self, x: mx.array, halo: int) -> tuple[mx.array, mx.array]:
        return decode_halo_rows(self._stores, self.layer, x, halo)

    def recurrence(self, name: str, original, spec: Recurrence, args: dict, halo: int):
        return decode_recurrence(self._stores, self.layer, original, spec, args, halo)

    @property
    def _stores(self) -> list[StateStore]:
        return [row.sequence.states for row in self.ring_pass.rows]
