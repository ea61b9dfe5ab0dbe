"""The conversations the ranks hold, as the front end sees them: each one's tokens and where it can be
cut, under the name the ranks know it by (GenerateRequest.sequence).

A prompt continues the held conversation it shares most with, if it keeps at least half of it (a
later turn, an answer asked again); otherwise it starts a new one, so that a request that shares only
the chat template's first tokens with a long conversation does not cut it. Past `limit` conversations, or past
`budget` bytes on some rank once an answer ends, the least recently used are let go (the prefix cache
on disk still has what it saved of them). Pure bookkeeping: the session tells the ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Held:
    """One conversation the ranks hold."""

    name: str
    tokens: list[int] = field(default_factory=list)  # whose K/V the ranks hold
    keep_floor: int = 0  # a later turn keeps at least this many tokens, or none
    state_positions: list[int] = field(default_factory=list)  # where linear layers' states roll back to
    saved: int = 0  # of the tokens, how many begin a prefix saved on the ranks' disks
    rank_bytes: tuple[int, ...] = ()  # each rank's K/V and state bytes of it
    used: int = 0  # when a request last ran it

    def kept(self, full: list[int]) -> int:
        """How many of `full`'s tokens this conversation holds and can keep (one is always left to read)."""
        keep = min(common_prefix(self.tokens, full), len(full) - 1)
        if self.state_positions:  # a recurrent state goes back only to where the ranks kept one
            keep = max((p for p in (*self.state_positions, len(self.tokens)) if p <= keep), default=0)
        return 0 if keep < self.keep_floor else keep  # sliding-window layers no longer hold what keep needs


class HeldConversations:
    """The conversations held, by name; `current` is the one the last request ran (or the next runs)."""

    def __init__(self, limit: int = 1, budget: int | None = None) -> None:
        self.limit, self.budget = limit, budget
        self.by_name: dict[str, Held] = {}
        self.current = Held("")  # held once a request runs it
        self.busy: set[str] = set()  # answers decoding in a batch run these: none continues or lets them go
        self._clock = itertools.count(1)
        self._names = (f"c{i}" for i in itertools.count(1))

    def continued(self, full: list[int]) -> tuple[Held | None, int]:
        """The held conversation `full` continues (None: a new one), and the tokens it keeps."""
        free = self._idle if self.by_name else [self.current]
        if not free:
            return None, 0
        keep, _, held = max(((h.kept(full), h is self.current, h) for h in free), key=lambda k: k[:2])
        if keep and (self.limit == 1 or 2 * keep >= len(held.tokens)):
            return held, keep
        return None, 0

    def run(self, held: Held | None) -> list[str]:
        """Make `held` (None: a new conversation) the current one; the names to let go to make room. With
        a limit of one, a new conversation takes the old one's place."""
        gone = []
        # a conversation a failed request began holds nothing: the ranks have let it go
        self.by_name = {n: h for n, h in self.by_name.items() if h.tokens or h is held}
        if held is None:
            if self.limit > 1:
                gone = self._let_go_least_recent(len(self.by_name) + 1 - self.limit, keep=None)
            held = Held(next(self._names) if self.limit > 1 else "")
            self.by_name[held.name] = held
        held.used = next(self._clock)
        self.current = held
        return gone

    def over_budget(self) -> list[str]:
        """After an answer: the least recently used let go until every rank holds at most the budget
        (the current one too, last, if it alone is over)."""
        gone: list[str] = []
        while self.budget is not None and self.by_name and max(self._rank_totals()) > self.budget:
            keep = self.current if len(self.by_name) > 1 else None
            if not (some := self._let_go_least_recent(1, keep)):
                break  # all busy
            gone += some
        return gone

    def least_recent(self, besides: Held | None) -> Held | None:
        """The least recently used conversation but `besides` (the memory check lets it go)."""
        others = [h for h in self._idle if h is not besides]
        return min(others, key=lambda h: h.used, default=None)

    def let_go(self, name: str) -> None:
        if self.by_name.pop(name, None) is self.current:
            self.current = Held(name)  # holds nothing now

    def clear(self) -> None:
        self.by_name, self.current, self.busy = {}, Held(""), set()

    @property
    def tokens(self) -> int:
        return sum(len(h.tokens) for h in self.by_name.values())

    @property
    def _idle(self) -> list[Held]:
        """The conversations held that no answer in a batch runs."""
        return [h for h in self.by_name.values() if h.name not in self.busy]

    def _rank_totals(self) -> list[int]:
        held = [h.rank_bytes for h in self.by_name.values()]
        return [sum(b) for b in itertools.zip_longest(*held, fillvalue=0)] or [0]

    def _let_go_least_recent(self, count: int, keep: Held | None) -> list[str]:
        order = sorted((h for h in self._idle if h is not keep), key=lambda h: h.used)
        names = [h.name for h in order[:max(count, 0)]]
        for name in names:
            self.let_go(name)
        return names
