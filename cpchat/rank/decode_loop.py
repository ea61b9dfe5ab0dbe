"""One answer's decode on this rank: every rank runs each new token through the model in lockstep (so all
hidden states agree), one rank keeps its K/V (round robin by position, in the shares), and the rank
that samples a token shares it with the others before the next step."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import numpy as np

from cpchat import blas
from cpchat.core.sharding import decode_owner
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank import gathered
from cpchat.rank.algorithms import DECODE, decode
from cpchat.rank.context_parallel import LayerCall, RingPass
from cpchat.rank.forward import run_model
from cpchat.rank.kvstore import KVShard
from cpchat.rank.model_load import ModelShape
from cpchat.rank.prefix_keeper import PrefixKeeper
from cpchat.rank.sampling import sample, token_event
from cpchat.rank.stages import Handoff
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Aborted, Ring
from cpchat.rank.transport.wire import BlockKey

# Decode steps that rank 0 runs alone (cpchat.rank.algorithms.decode): the others cannot advance a
# recurrent state with it, and rank 0 takes every core for its products.
RANK_0_ALONE = frozenset({"lead", "gather"})

_streams = threading.local()  # MLX streams belong to the thread that made them


class Held(Protocol):
    """What a decode loop reads and advances of the engine: the model, this rank's K/V and the
    ring's token count, and how a ring pass is made and recorded."""

    model: object
    info: ModelShape
    kv: KVShard
    states: StateStore
    total_tokens: int
    layer_calls: dict[int, LayerCall]
    prefix: PrefixKeeper

    def ring_pass(self, request_id: str, algorithm: str, ring: Ring, abort: threading.Event,
                  positions: np.ndarray, real: np.ndarray, row_offsets: mx.array | int, start: int,
                  seq_len: int, **extra) -> RingPass: ...

    def record(self, ring_pass: RingPass) -> None: ...

    def record_no_pass(self, algorithm: str) -> None: ...

    def handoff(self, world: Ring, request_id: str, step: int, abort: threading.Event,
                context_rank: int) -> Handoff | None: ...


class DecodeLoop:
    """The decode of one request on this rank. `ring` is its stage's context ring, `world` every rank
    (the same ring but for pipeline stages): the last stage samples, and every rank takes the token."""

    def __init__(self, held: Held, req: pb.GenerateRequest, world: Ring, ring: Ring,
                 abort: threading.Event) -> None:
        self.held, self.req, self.world, self.ring, self.abort = held, req, world, ring, abort
        place = held.info.place
        self.sampler = place.world_rank(place.stages - 1, 0)  # the rank that samples each step's token
        self.step_kind = DECODE[req.decode].name
        self.shares = tuple(req.shares) or None
        self.gathered: gathered.Gathered | None = None  # rank 0's view of every rank's K/V in a gather step
        self.handing: deque[tuple[int, int, gathered.NewKV]] = deque()  # its steps' new K/V, to hand on
        self.keepers: dict[int, int] = {}  # each answer position's K/V: the rank that keeps them
        self.steps = 0  # forwards of this answer so far

    def sample_and_share(self, source: int, index: int, logits: mx.array | None) -> pb.TokenEvent:
        """Rank `source` (of the whole ring) samples token `index` and sends it to every other rank."""
        if self.world.rank == source:
            sampled = sample(logits, self.req.sampling, index)
            mx.eval(sampled)
            self.share(index, sampled)
            return token_event(sampled)
        arrays, _ = self.world.take(BlockKey(self.req.request_id, 0, index, pb.TOKEN), self.abort, source)
        return token_event(arrays)

    def share(self, index: int, sampled: list[mx.array]) -> None:
        if self.world.size > 1:
            self.world.send_all(BlockKey(self.req.request_id, 0, index, pb.TOKEN),
                                [a.reshape(-1) for a in sampled], self.world.peers)

    def threads(self) -> contextlib.AbstractContextManager:
        """In a lead or gather step rank 0 runs the weight products alone, on every core of the machine."""
        if self.ring.rank == 0 and self.ring.size > 1 and self.step_kind in RANK_0_ALONE:
            return blas.threads(blas.usable_cores())
        return contextlib.nullcontext()

    def run(self, emit: Callable[[pb.GenerateEvent], None], first: pb.TokenEvent, stop: set[int],
            quantize_by: Callable[[int], None]) -> int:
        """Emit the first token and decode the rest; the last token (emitted, or the stop token)."""
        if first.id not in stop and self.req.max_tokens:
            emit(pb.GenerateEvent(token=first))
            first = self.run_from(emit, first, 0, stop, quantize_by)[0]
        self.hand_back()
        return first.id

    def run_from(self, emit: Callable[[pb.GenerateEvent], None], event: pb.TokenEvent, index: int,
                 stop: set[int], quantize_by: Callable[[int], None],
                 until: Callable[[int, int], bool] | None = None) -> tuple[pb.TokenEvent, int, bool]:
        """Decode on from answer token `index` (`event`: emitted, not yet read), a token a step, until the
        answer ends or `until` says so (told each token read and the one that came of it; a step under
        way ends first). The last token decided (emitted, or the stop token), its index, and whether
        the answer ended.
        A rank alone runs as mlx-lm's generate_step does: the step after next is built from the next
        token before that token is known, so building one step overlaps evaluating the other, and a
        step built from what turns out to be a stop token is forgotten; so does rank 0 in gather steps,
        handing each step on once evaluated. Other ranks of a ring take each token from the
        sampling rank before they step (linear layers' states keep that order too)."""
        held, req, ring = self.held, self.req, self.ring
        alone = ring.size == 1 or (ring.rank == 0 and self.step_kind == "gather")
        pipelined = alone and not held.info.linear and self.world.size == ring.size  # one stage

        def step_ahead(previous: int | mx.array, index: int) -> list[mx.array]:
            quantize_by(held.total_tokens)
            pending = sample(self.step(previous, evaluate=False), req.sampling, index)
            mx.async_eval(*pending)
            return pending

        ahead, stopping = None, False  # ahead: the step that gives token index + 1, under way
        while index + 1 < req.max_tokens:
            if self.abort.is_set():
                raise Aborted(req.request_id)
            token = event.id
            if pipelined:
                ahead = step_ahead(token, index + 1) if ahead is None else ahead
                building = index + 2 < req.max_tokens and not stopping
                following = step_ahead(ahead[0], index + 2) if building else None
                held.prefix.read_token(token)
                event = token_event(ahead)
                if ring.size > 1:  # a gather step, handed on while the next one evaluates
                    self.hand_on(index + 1, ahead)
                ahead = following
            else:
                quantize_by(held.total_tokens)
                logits = self.step(token)
                if self.handing:  # a gather step's new K/V, evaluated: to the rank that keeps them
                    self.hand_on_kv()
                held.prefix.read_token(token)
                event = self.sample_and_share(self.sampler, index + 1, logits)
            index += 1
            stopping = stopping or (until is not None and until(token, event.id))
            if event.id in stop:
                if ahead is not None:  # built from a stop token: its K/V go
                    held.total_tokens -= 1
                    held.kv.truncate(held.total_tokens)
                return event, index, True
            emit(pb.GenerateEvent(token=event))
            if stopping and ahead is None:
                return event, index, False
        return event, index, True

    def hand_back(self) -> None:
        """After a gather answer: rank 0's share of its tokens' K/V, from the gathered copy to its shard."""
        if self.gathered is not None:
            self.gathered.hand_back(self.held.kv, lambda p: self.keepers[p] == 0,
                                    below=self.held.total_tokens)

    def step(self, token: int | mx.array | list[int], evaluate: bool = True) -> mx.array | None:
        """One step: a token's (logits [vocab]), or a block of tokens', each seeing those before it (a
        speculative block: logits [n, vocab]). `token` may be a graph still being evaluated (a
        pipelined step, which is left a graph too). One rank keeps the step's K/V."""
        held, ring = self.held, self.ring
        position, count = held.total_tokens, len(token) if isinstance(token, list) else 1
        positions = np.arange(position, position + count)
        keeper = decode_owner(position, ring.size, self.shares)
        self.keepers.update(dict.fromkeys(range(position, position + count), keeper))
        if isinstance(token, list):
            ids, row = mx.array([token]), slice(0, count)
        else:
            ids, row = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[token]]), 0
        self.steps += 1
        if self.step_kind == "gather" and ring.size > 1:
            logits = self.gather_step(ids, row, positions, keeper, evaluate)
            held.total_tokens = position + count
            return logits
        store = keeper == ring.rank
        if store:
            held.kv.begin_append(positions)
        ring_pass = held.ring_pass(self.req.request_id, self.step_kind, ring, self.abort, positions,
                                   np.ones(count, bool), position, position, count, store=store,
                                   keeper=keeper, tick=self.steps)
        if self.step_kind == "lead" and ring.rank != 0:
            decode.follow(ring_pass, [held.layer_calls[i] for i in sorted(held.layer_calls)])
            if store:
                held.kv.commit()
            logits = None
        else:
            logits = run_model(held.model, ring_pass, ids, row=row, evaluate=evaluate,
                               handoff=self.handoff(position))
        held.record(ring_pass)
        held.total_tokens = position + count
        return logits if ring.rank == 0 else None

    def handoff(self, position: int) -> Handoff | None:
        return self.held.handoff(self.world, self.req.request_id, position, self.abort, self.ring.rank)

    def gather_step(self, ids: mx.array, row: int | slice, positions: np.ndarray, keeper: int,
                    evaluate: bool) -> mx.array | None:
        """A gather step (cpchat.rank.gathered): rank 0 runs it alone over every rank's K/V, as a rank
        alone does, and `hand_on` gives the new tokens' K/V to the rank that keeps them once evaluated;
        the others only keep theirs."""
        held, ring, request_id, position = self.held, self.ring, self.req.request_id, int(positions[0])
        if ring.rank != 0:
            held.record_no_pass("gather")
            if keeper == ring.rank:
                arrays, _ = ring.take(gathered.new_kv_key(request_id, position), self.abort, 0)
                self.keep_new(position, gathered.unpack_new(arrays))
            return None
        if self.gathered is None:
            self.gathered = gathered.gather_shards(held.kv, ring, self.abort, request_id)
        if held.kv.quantized and not self.gathered.quantized:
            self.gathered.quantize()
        self.gathered.new.begin_append(positions)
        count = len(positions)
        ring_pass = held.ring_pass(request_id, "gather", Ring(0, 1, {}, ring.mailbox), self.abort,
                                   positions, np.ones(count, bool), position, position, count,
                                   kv=self.gathered.new, keeper=keeper, hand_on=True,
                                   held=self.gathered.blocks(held.kv), tick=self.steps)
        logits = run_model(held.model, ring_pass, ids, row=row, evaluate=evaluate,
                           handoff=self.handoff(position))
        held.record(ring_pass)
        self.handing.append((position, keeper, ring_pass.unkept))
        return logits

    def hand_on(self, index: int, sampled: list[mx.array]) -> None:
        """After a gather step is evaluated: its new K/V to the rank that keeps them, its token to
        every other rank. On an MLX stream of their own: the default one is evaluating the next step,
        and anything queued behind it would wait for it."""
        if not hasattr(_streams, "side"):
            _streams.side = mx.new_stream(mx.cpu)
        with mx.stream(_streams.side):
            self.hand_on_kv()
            self.share(index, sampled)

    def hand_on_kv(self, below: int | None = None) -> None:
        """The oldest gather step's new K/V (those before position `below`: a speculative block's
        kept ones), to the rank that keeps them (rank 0's own stay in self.gathered.new until the
        answer ends)."""
        position, keeper, new = self.handing.popleft()
        if below is not None:
            new = {layer: (k[..., :below - position, :], v[..., :below - position, :])
                   for layer, (k, v) in new.items()}
        if keeper:
            self.ring.send(gathered.new_kv_key(self.req.request_id, position), gathered.pack_new(new),
                           to=keeper)

    def keep_new(self, position: int, new: gathered.NewKV) -> None:
        kv = self.held.kv
        kv.begin_append(np.arange(position, position + next(iter(new.values()))[0].shape[2]))
        for layer, (k, v) in sorted(new.items()):
            kv.append(layer, k, v)
        kv.commit()
