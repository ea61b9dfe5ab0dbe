"""The conversations a rank holds besides the one it runs, by name (GenerateRequest.sequence).

The engine runs one conversation at a time over its own fields (its K/V shard, the linear layers'
states, the ring's token count, ...); to continue another it parks those here and takes the other's
back: references change hands, nothing is copied. The front end chooses which conversations stay and
lets the others go (Reset with keep_tokens 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cpchat.rank.kvstore import KVShard
from cpchat.rank.prefix_cache import Entry
from cpchat.rank.prefix_keeper import PrefixKeeper
from cpchat.rank.statestore import StateStore


class Runs(Protocol):
    """What the engine holds of the conversation it runs."""

    kv: KVShard
    states: StateStore
    total_tokens: int
    unread: tuple[int, int] | None
    keep_floor: int
    prefix: PrefixKeeper


@dataclass
class Sequence:
    """One parked conversation: what `Runs` holds of it, and what the prefix cache knows of it."""

    kv: KVShard
    states: StateStore
    total_tokens: int
    unread: tuple[int, int] | None
    keep_floor: int
    tokens: np.ndarray
    segments: list[tuple[int, ...]]
    origin: Entry | None

    @classmethod
    def of(cls, engine: Runs) -> Sequence:
        p = engine.prefix
        return cls(engine.kv, engine.states, engine.total_tokens, engine.unread, engine.keep_floor, p.tokens,
                   p.segments, p.origin)

    def into(self, engine: Runs) -> None:
        engine.kv, engine.states, engine.total_tokens = self.kv, self.states, self.total_tokens
        engine.unread, engine.keep_floor = self.unread, self.keep_floor
        p = engine.prefix
        p.tokens, p.segments, p.origin = self.tokens, self.segments, self.origin

    @classmethod
    def empty(cls, kv: KVShard) -> Sequence:
        return cls(kv, StateStore(), 0, None, 0, np.zeros(0, np.uint32), [], None)


def why_not_keep(held: Runs | Sequence | None, keep_tokens: int, linear: bool) -> str | None:
    """Why a conversation (None: one not held) cannot keep its first `keep_tokens` tokens; None if it can.
    `linear`: the model has linear-attention layers, whose states roll back only to a snapshot."""
    if held is None:
        return None if keep_tokens == 0 else "the ring holds 0"
    total, floor, snapshots = held.total_tokens, held.keep_floor, held.states.snapshots
    if keep_tokens > total:
        return f"the ring holds {total}"
    if 0 < keep_tokens < floor:
        return f"sliding-window layers hold keys for {floor} tokens on; keep those or none"
    if linear and keep_tokens not in (total, *snapshots):
        cuts = ", ".join(map(str, sorted({total, *snapshots})))
        return f"linear-attention layers hold their state after {cuts} tokens only"
    return None


class Parked:
    """The conversations parked on this rank, and the name of the one the engine runs."""

    def __init__(self) -> None:
        self.running: str | None = ""  # None: the engine runs none (a batched step parked them all)
        self.by_name: dict[str, Sequence] = {}

    def switch(self, engine: Runs, name: str | None, new_kv: Callable[[], KVShard]) -> None:
        """Park the running conversation (unless it holds nothing) and run `name`'s (a new one if none)."""
        if name == self.running:
            return
        if engine.total_tokens:
            self.by_name[self.running] = Sequence.of(engine)
        parked = self.by_name.pop(name, None)
        (parked or Sequence.empty(new_kv())).into(engine)
        self.running = name

    def side_by_side(self, engine: Runs, names: list[str], new_kv: Callable[[], KVShard]) -> list[Sequence]:
        """Conversations `names`, all parked (the running one too), for a step over them together."""
        self.switch(engine, None, new_kv)
        return [self.by_name[name] for name in names]

    def find(self, engine: Runs, name: str) -> Runs | Sequence | None:
        """Conversation `name`: the engine's if it runs, parked, or None."""
        return engine if name == self.running else self.by_name.get(name)

    def release(self, name: str) -> bool:
        """Let a parked conversation go; False if `name` is not parked."""
        return self.by_name.pop(name, None) is not None

    def __len__(self) -> int:
        return len(self.by_name)

    def clear(self) -> None:
        self.by_name.clear()
        self.running = ""

    def totals(self, engine: Runs) -> tuple[int, int, int]:
        """Tokens, K/V bytes and state bytes of every conversation held, the one `engine` runs too (from
        the stats thread as well)."""
        held = [engine, *self.by_name.values()]
        return (sum(len(s.kv) for s in held), sum(s.kv.nbytes for s in held),
                sum(s.states.nbytes for s in held))
