"""Head-tail ("zigzag") sharding of a sequence over N ranks, in shares.

Rank i holds two chunks of the same length c_i: a head chunk, counted from the start of the
sequence in rank order, and a tail chunk, at the mirror place counted from the end. Under a causal
mask a query at position p reads p+1 keys, so rank i's two chunks read c_i · (P+1) pairs whatever
its place (P the padded length): attention work, like the weights' work, is proportional to the
share. `shares` (positive integers, one a rank) set the c_i: c_i = ⌈⌈T/2⌉ · s_i / Σs⌉, so equal
shares cut the sequence into 2N equal chunks, padded at its end to a multiple of 2N. Padded
positions (>= seq_len) are never returned as real tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Shares = tuple[int, ...]  # one positive integer a rank, in rank order


def equal_shares(num_ranks: int) -> Shares:
    return (1,) * num_ranks


def integer_shares(weights: Sequence[float], resolution: int = 64) -> Shares:
    """Weights (positive numbers) as small integers in the same proportions: integers as given,
    others to 1/`resolution` of the largest; divided by their common factor."""
    if not weights or any(not w > 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"shares must be positive numbers, got {list(weights)}")
    if all(float(w).is_integer() for w in weights):
        ints = [int(w) for w in weights]
    else:
        ints = [max(1, round(resolution * w / max(weights))) for w in weights]
    common = math.gcd(*ints)
    return tuple(i // common for i in ints)


def _check(seq_len: int, num_ranks: int, rank: int | None = None, shares: Shares | None = None) -> Shares:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if rank is not None and not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    shares = shares or equal_shares(num_ranks)
    if len(shares) != num_ranks or min(shares) < 1:
        raise ValueError(f"{num_ranks} ranks need {num_ranks} positive shares, got {list(shares)}")
    return shares


def chunk_lengths(seq_len: int, num_ranks: int, shares: Shares | None = None) -> list[int]:
    """c_i: the length of each rank's head chunk, and of its tail chunk."""
    shares = _check(seq_len, num_ranks, shares=shares)
    half, total = -(-seq_len // 2), sum(shares)
    return [-(-half * s // total) for s in shares]


def padded_length(seq_len: int, num_ranks: int, shares: Shares | None = None) -> int:
    """seq_len rounded up to the chunks' total: a multiple of 2N for equal shares."""
    return 2 * sum(chunk_lengths(seq_len, num_ranks, shares))


@dataclass(frozen=True)
class RowLayout:
    """A rank's two chunks as two rows of a batch: row r covers
    positions [starts[r], starts[r] + chunk) of the padded sequence."""

    starts: tuple[int, int]
    chunk: int
    seq_len: int

    def row_positions(self) -> list[list[int]]:
        return [list(range(s, s + self.chunk)) for s in self.starts]

    def positions(self) -> list[int]:
        """All padded positions, row 0 then row 1 (the flattened order)."""
        return [p for row in self.row_positions() for p in row]

    def real_mask(self) -> list[bool]:
        return [p < self.seq_len for p in self.positions()]


def head_tail_layout(seq_len: int, num_ranks: int, rank: int, shares: Shares | None = None) -> RowLayout:
    _check(seq_len, num_ranks, rank, shares)
    lengths = chunk_lengths(seq_len, num_ranks, shares)
    head = sum(lengths[:rank])
    tail = 2 * sum(lengths) - head - lengths[rank]
    return RowLayout(starts=(head, tail), chunk=lengths[rank], seq_len=seq_len)


def head_tail_positions(seq_len: int, num_ranks: int, rank: int, shares: Shares | None = None) -> list[int]:
    """Global positions of the real tokens that `rank` holds, ascending."""
    layout = head_tail_layout(seq_len, num_ranks, rank, shares)
    return [p for p in layout.positions() if p < seq_len]


def owner_of(position: int, seq_len: int, num_ranks: int, shares: Shares | None = None) -> int:
    """The rank that holds `position` under head-tail sharding."""
    _check(seq_len, num_ranks, shares=shares)
    if not 0 <= position < seq_len:
        raise ValueError(f"position {position} outside [0, {seq_len})")
    return int(owners(np.array([position]), seq_len, num_ranks, shares)[0])


def owners(positions: np.ndarray, seq_len: int, num_ranks: int, shares: Shares | None = None) -> np.ndarray:
    """The rank that holds each of `positions` (in [0, seq_len)) under head-tail sharding."""
    lengths = chunk_lengths(seq_len, num_ranks, shares)
    padded = 2 * sum(lengths)
    from_edge = np.minimum(positions, padded - 1 - positions)  # a tail position mirrors a head one
    return np.searchsorted(np.cumsum(lengths), from_edge, side="right")


def rank_tokens(seq_len: int, num_ranks: int, shares: Shares | None = None) -> list[int]:
    """The real tokens each rank holds (padding left out)."""
    return np.bincount(owners(np.arange(seq_len), seq_len, num_ranks, shares), minlength=num_ranks).tolist()


def decode_owner(position: int, num_ranks: int, shares: Shares | None = None) -> int:
    """The rank that keeps a decoded token's K/V: round robin, each rank as often as its share
    (rank p % N for equal shares)."""
    order = _round_robin(_check(1, num_ranks, shares=shares))
    return order[position % len(order)]


@functools.lru_cache(maxsize=64)
def _round_robin(shares: Shares) -> tuple[int, ...]:
    """One cycle of smooth weighted round robin: rank i comes up s_i times in Σs, spread out."""
    common = math.gcd(*shares)
    shares = tuple(s // common for s in shares)
    total, current, order = sum(shares), [0] * len(shares), []
    for _ in range(total):
        current = [c + s for c, s in zip(current, shares, strict=True)]
        chosen = current.index(max(current))
        current[chosen] -= total
        order.append(chosen)
    return tuple(order)


@dataclass(frozen=True)
class HeadShare:
    """One rank's heads under Ulysses: query heads [start, stop), and the key heads they read, a
    range when every query group is whole, otherwise one key head per query head."""

    start: int
    stop: int
    kv_index: range | list[int]

    @property
    def whole_groups(self) -> bool:
        return isinstance(self.kv_index, range)


def head_split(q_heads: int, kv_heads: int, num_ranks: int, shares: Shares | None = None) -> list[HeadShare]:
    """Query heads cut into contiguous runs in proportion to `shares`, as near as whole heads allow
    (equal shares: sizes differ by at most one; empty when there are more ranks than heads). A query
    group whose heads fall on two ranks has its key head on both, as plain multi-head attention
    there: more bytes, never a wrong answer."""
    if num_ranks < 1 or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"cannot share {q_heads} query heads ({kv_heads} key heads) among {num_ranks} ranks")
    shares = _check(1, num_ranks, shares=shares)
    group, cumulative = q_heads // kv_heads, np.cumsum([0, *shares]).tolist()
    bounds = [q_heads * c // cumulative[-1] for c in cumulative]
    shares = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        whole = lo % group == 0 and hi % group == 0
        shares.append(HeadShare(lo, hi, range(lo // group, hi // group) if whole
                                else [h // group for h in range(lo, hi)]))
    return shares
