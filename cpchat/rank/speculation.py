"""Speculative decoding on a rank: each step checks the last token and up to k proposed ones
(cpchat.core.lookup) as one causal block through every layer, then keeps the longest prefix the model
itself would have produced, as mlx-lm's speculative generation does: the model is sampled at each
position (the seed of each answer position, as without proposals) and a proposal stays while it
equals the sample. Greedy answers and the sampling distribution are those of one token a step.

Every rank holds the conversation's token ids (cpchat.rank.prefix_keeper), so every rank makes the
same lookup proposals itself: only the sampling rank's decision crosses the ring, one frame a step as
without proposals. A draft model (cpchat.rank.draft) runs on the sampling rank alone, which sends its
proposals before each step. Whatever the model did not keep is rolled back on every rank: K/V (a
linear layer's state is restored from before the block and the kept tokens run again)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from cpchat.core.lookup import DraftLength, propose
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.draft import DRAFT_TOKENS, DraftModel
from cpchat.rank.sampling import sample, token_event
from cpchat.rank.transport.ring import Aborted
from cpchat.rank.transport.wire import BlockKey

if TYPE_CHECKING:
    from cpchat.rank.decode_loop import DecodeLoop


class Speculation:
    """One answer's speculative decode on this rank, over `loop`'s steps; `quantize_at` the position
    from which the K/V turn quantized (a block never spans it: mlx-lm quantizes before a step);
    `query_s` what a proposed token adds to a step here, estimated (DraftLength)."""

    def __init__(self, loop: DecodeLoop, quantize_at: int | None, draft: DraftModel | None = None,
                 query_s: float = 0.0) -> None:
        self.loop, self.quantize_at, self.draft = loop, quantize_at, draft
        self.drafted = loop.req.speculation == pb.SPECULATION_DRAFT  # proposals from the sampling rank
        self.length = DraftLength(fixed=loop.req.draft_tokens or (DRAFT_TOKENS if self.drafted else 0),
                                  query_s=query_s)
        self.k = self.length.next()  # the next step's proposals at most: the sampling rank's choice
        self.unsent: np.ndarray | None = None  # a proposal not checked (k = 0), scored against what came
        self.timed = 0.0  # when the last plain step ended (a rank alone)
        self.steps = 0

    @property
    def counts(self) -> tuple[int, int, int]:
        """Tokens proposed and accepted so far, and the steps that checked them."""
        return self.length.proposed, self.length.accepted, self.steps

    def run(self, emit: Callable[[pb.GenerateEvent], None], first: pb.TokenEvent, stop: set[int],
            quantize_by: Callable[[int], None]) -> int:
        """Emit the first token and decode the rest; the last token (emitted, or the stop token)."""
        loop, req = self.loop, self.loop.req
        held = loop.held
        last, index = first, 0  # the latest token decided (not yet read into the K/V), its answer index
        if last.id in stop or not req.max_tokens:
            return last.id
        emit(pb.GenerateEvent(token=last))
        while index + 1 < req.max_tokens:
            if loop.abort.is_set():
                raise Aborted(req.request_id)
            if self.k == 0 and loop.world.size == 1:  # alone: plain steps, each built while one evaluates
                self.timed = 0.0
                before, (last, index, ended) = index, loop.run_from(emit, last, index, stop, quantize_by,
                                                                    until=self.proposals_pay)
                self.steps += index - before
                if ended:
                    break
                continue
            start = held.total_tokens
            block = [last.id, *self.proposals(last.id, index + 1, start)]
            quantize_by(start)
            states = dict(held.states.layers) if held.info.linear else {}
            began = time.perf_counter()
            logits = loop.step(block)
            self.steps += 1
            decided = self.decide(block, logits, index + 1, began)
            taken = 0  # of `decided`, the tokens this answer takes (the last may be a stop token)
            for event in decided:
                taken, index, last = taken + 1, index + 1, event
                if event.id in stop:
                    break
                emit(pb.GenerateEvent(token=event))
                if index + 1 >= req.max_tokens:
                    break
            self.roll_back(block, start, taken, states)
            if last.id in stop:
                break
        loop.hand_back()
        return last.id

    def proposals_pay(self, token: int, following: int) -> bool:
        """Between plain steps (a rank alone): score the proposal the conversation up to `token` made
        against the token that came, `following`, and time the step; whether to propose again."""
        now = time.perf_counter()
        self.length.record(0, 0, now - self.timed if self.timed else 0.0)  # the first one starts a pipeline
        self.timed = now
        guess = propose(self.loop.held.prefix.tokens, 1)
        if len(guess):
            self.length.score(1, int(guess[0] == following))
        self.k = self.length.next()
        return self.k > 0

    def proposals(self, last: int, index: int, start: int) -> list[int]:
        """What follows `last` (at position `start`) in the conversation so far, for answer tokens
        `index` on: no more than the answer can still take, nor across the point where the K/V turn
        quantized."""
        loop = self.loop
        k = min(self.k, loop.req.max_tokens - index - 1)
        if self.quantize_at is not None and start < self.quantize_at:
            k = min(k, self.quantize_at - start - 1)
        if self.drafted:
            return self.drafted_proposals(last, index, k) if k >= 1 else []
        context = np.append(loop.held.prefix.tokens, np.uint32(last))
        sampler = loop.world.rank == loop.sampler
        self.unsent = propose(context, 1) if sampler and self.k == 0 and k >= 0 else None
        return propose(context, k).tolist() if k >= 1 else []

    def drafted_proposals(self, last: int, index: int, k: int) -> list[int]:
        """The draft model's `k` proposals after `last`: made on the sampling rank, which sends them to
        the others."""
        loop = self.loop
        key = BlockKey(loop.req.request_id, 0, index, pb.DRAFT)
        if loop.world.rank != loop.sampler:
            return loop.world.take(key, loop.abort, loop.sampler)[0][0].tolist()
        assert self.draft is not None
        proposed = self.draft.propose(np.append(loop.held.prefix.tokens, np.uint32(last)), k)
        if loop.world.size > 1:
            loop.world.send_all(key, [mx.array(proposed, mx.uint32)], loop.world.peers)
        return proposed

    def decide(self, block: list[int], logits: mx.array | None, index: int, began: float
               ) -> list[pb.TokenEvent]:
        """The sampling rank samples every position of the block (answer tokens `index` on) and keeps
        the samples up to the first that differs from the proposal it checks, that one included; it
        chooses how many to propose next (from this step's time, `began` on, and what held) and sends
        both to every other rank."""
        loop = self.loop
        key = BlockKey(loop.req.request_id, 0, index, pb.TOKEN)
        if loop.world.rank != loop.sampler:
            *arrays, k = loop.world.take(key, loop.abort, loop.sampler)[0]
            self.length.record(len(block) - 1, arrays[0].shape[0] - 1)
            self.k = int(k.item())
            return [token_event([a[i] for a in arrays]) for i in range(arrays[0].shape[0])]
        samples = [sample(logits[i], loop.req.sampling, index + i) for i in range(len(block))]
        mx.eval(samples)
        events = [token_event(s) for s in samples]
        kept = next((i for i in range(1, len(block)) if events[i - 1].id != block[i]), len(block))
        self.length.record(len(block) - 1, kept - 1, time.perf_counter() - began)
        if self.unsent is not None and len(self.unsent):
            self.length.score(1, int(self.unsent[0] == events[0].id))
        self.k = self.length.next()
        if loop.world.size > 1:  # each field's values, a row a token; then the next step's k
            fields = zip(*[[np.asarray(a).reshape(-1) for a in s] for s in samples[:kept]], strict=True)
            loop.world.send_all(key, [*(mx.array(np.stack(f)) for f in fields), mx.array([self.k])],
                                loop.world.peers)
        return events[:kept]

    def roll_back(self, block: list[int], start: int, taken: int, states: dict) -> None:
        """Keep the block's first `taken` tokens (those before the last token decided) in the K/V and
        the linear layers' states, and hand a gather step's kept K/V on."""
        loop = self.loop
        held, keep = loop.held, start + taken
        if keep < start + len(block) and held.info.linear:
            # states cannot be cut back: from before the block (`states`), the kept tokens again
            held.states.layers = states
            held.kv.truncate(start)
            held.total_tokens = start
            loop.step(block[:taken])
        elif keep < start + len(block):
            held.kv.truncate(keep)
            if loop.gathered is not None:
                loop.gathered.new.truncate(keep)
            held.total_tokens = keep
        if loop.handing:
            loop.hand_on_kv(keep)
        for token in block[:taken]:
            held.prefix.read_token(token)
