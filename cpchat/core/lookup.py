"""Proposals for speculative decoding drawn from the conversation itself (prompt lookup): an answer
about a document often quotes it, so the tokens that followed an earlier occurrence of the answer's
last few tokens are likely to come next.

`propose` finds the longest suffix of the tokens so far (at least MIN_MATCH, at most MAX_MATCH tokens)
that occurred before and proposes the k tokens that followed one of its occurrences. It is a
vectorised scan of the token ids, about 0.03 ms at 128K tokens (well under a decode step), so the
ids themselves are the index: nothing to build or keep in step with rollbacks. `DraftLength` chooses
k from what a check costs and how many proposals hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_MATCH = 1
MAX_MATCH = 16
MAX_DRAFT = 16  # the longest proposal
SPECULATE = ("off", "lookup", "auto", "draft:MODEL")  # --speculate


def speculation_valid(value: str) -> bool:
    """One of SPECULATE, a draft model named after `draft:`."""
    return value in SPECULATE or (value.startswith("draft:") and value != "draft:")


def propose(tokens: np.ndarray, k: int) -> np.ndarray:
    """`k` tokens that followed an earlier occurrence of the longest suffix of `tokens` (MIN_MATCH to
    MAX_MATCH tokens long) that occurred before: of its occurrences, the latest of those followed by the
    most common next token; as a copy that overlaps itself where that occurrence is less than k tokens
    back (a loop goes on looping). None if no such suffix occurred."""
    end = len(tokens)
    if k < 1 or end <= MIN_MATCH:
        return tokens[:0]
    starts = np.flatnonzero(tokens[:end - 1] == tokens[end - 1])  # ends of one-token matches
    length = 1
    while length < MAX_MATCH and len(starts):
        earlier = starts - length
        agree = starts[(earlier >= 0) & (tokens[np.maximum(earlier, 0)] == tokens[end - 1 - length])]
        if not len(agree):
            break
        starts, length = agree, length + 1
    if length < MIN_MATCH or not len(starts):
        return tokens[:0]
    following = tokens[starts + 1]  # each occurrence's next token: the most common one goes on
    values, counts = np.unique(following, return_counts=True)
    common = values[counts == counts.max()]
    after = int(starts[np.isin(following, common)][-1]) + 1
    period = end - after  # the match repeats every `period` tokens: it goes on past the end the same way
    return tokens[after + np.arange(k) % period]


@dataclass
class DraftLength:
    """How many tokens to propose next: `fixed` if set (--draft-tokens), else the k that gives the most
    tokens a second. A step that checks k proposals takes (1 + cost k) times a plain step, and gives
    1 + a + a^2 + ... + a^k tokens where each proposal holds with probability a; both are measured on
    the answer's own steps, recent ones weighing most (a quote begins and ends), from a prior of a = 1/4.
    The cost starts at a quarter step a token; from the first plain step on it is `query_s` (what a
    proposed token adds to a step, by the rank's measured forward cost) over that step's time, and from
    the first check on the checks' own times (on a CPU a token costs 2-30 % of a step, the more the
    longer the context). k at most doubles on what the last check kept, so that one lucky check does not
    bring a long one. A proposal not sent (k = 0) is still scored against the token the step made, so
    that the next quote is noticed."""

    fixed: int = 0
    held: float = 0.5  # decayed counts: proposals that held, and those that did not
    missed: float = 1.5
    cost: float = 0.25  # each proposed token's share of a plain step's time
    query_s: float = 0.0  # seconds a proposed token adds to a step, estimated (0: unknown)
    costed: bool = False  # whether `cost` was measured yet
    plain_s: float = 0.0  # a plain step's time, decayed mean (0: none seen yet)
    last_held: int = 0  # of the last proposals checked or scored
    proposed: int = 0  # this answer's totals
    accepted: int = 0

    DECAY = 0.8
    MIN_COST = 0.02  # a token's share of a step, at least (one step's timing is noisy)

    def next(self) -> int:
        if self.fixed:
            return self.fixed
        a = self.held / (self.held + self.missed)
        k = np.arange(MAX_DRAFT + 1)
        gain = np.cumsum(a ** k) / (1 + self.cost * k)  # tokens a step over its time, for each k
        return min(int(np.argmax(gain)), 2 * self.last_held + 2)

    def record(self, proposed: int, accepted: int, seconds: float = 0.0) -> None:
        """A step that checked `proposed` tokens and kept `accepted`, in `seconds` (0: not timed)."""
        self.proposed += proposed
        self.accepted += accepted
        self.score(proposed, accepted)
        if seconds <= 0:
            return
        if not proposed:
            self.plain_s = self._mean(self.plain_s, seconds) if self.plain_s else seconds
            if self.query_s and not self.costed:
                self.cost = max(self.query_s / self.plain_s, self.MIN_COST)
        elif self.plain_s:
            cost = max(seconds / self.plain_s - 1, self.MIN_COST * proposed) / proposed
            self.cost, self.costed = self._mean(self.cost, cost) if self.costed else cost, True

    def score(self, proposed: int, accepted: int) -> None:
        """Proposals checked (or, not sent, compared with what came), one observation each up to the
        first that missed: each observation weighs the earlier ones down by DECAY."""
        if proposed:
            self.last_held = accepted
        for held in [True] * accepted + [False] * (accepted < proposed):
            self.held, self.missed = self.DECAY * self.held + held, self.DECAY * self.missed + (not held)

    def _mean(self, mean: float, value: float) -> float:
        return self.DECAY * mean + (1 - self.DECAY) * value
