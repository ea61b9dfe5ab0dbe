"""Head-tail ("zigzag") sharding of a sequence over N ranks.

The sequence is padded at its end to a multiple of 2N and cut into 2N equal
chunks; rank i holds chunks i and 2N-1-i. Under a causal mask, chunk c costs
about c+1 units of work, so every rank gets (i+1) + (2N-i) = 2N+1 units.
Padded positions (>= seq_len) are never returned as real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _check(seq_len: int, num_ranks: int, rank: int | None = None) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if rank is not None and not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")


def padded_length(seq_len: int, num_ranks: int) -> int:
    """seq_len rounded up to a multiple of 2N."""
    _check(seq_len, num_ranks)
    step = 2 * num_ranks
    return -(-seq_len // step) * step


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


def head_tail_layout(seq_len: int, num_ranks: int, rank: int) -> RowLayout:
    _check(seq_len, num_ranks, rank)
    chunk = padded_length(seq_len, num_ranks) // (2 * num_ranks)
    head, tail = rank, 2 * num_ranks - 1 - rank
    return RowLayout(starts=(head * chunk, tail * chunk), chunk=chunk, seq_len=seq_len)


def head_tail_positions(seq_len: int, num_ranks: int, rank: int) -> list[int]:
    """Global positions of the real tokens that `rank` holds, ascending."""
    layout = head_tail_layout(seq_len, num_ranks, rank)
    return [p for p in layout.positions() if p < seq_len]


def owner_of(position: int, seq_len: int, num_ranks: int) -> int:
    """The rank that holds `position` under head-tail sharding."""
    _check(seq_len, num_ranks)
    if not 0 <= position < seq_len:
        raise ValueError(f"position {position} outside [0, {seq_len})")
    return int(owners(np.array([position]), seq_len, num_ranks)[0])


def owners(positions: np.ndarray, seq_len: int, num_ranks: int) -> np.ndarray:
    """The rank that holds each of `positions` (in [0, seq_len)) under head-tail sharding."""
    _check(seq_len, num_ranks)
    chunk_index = positions // (padded_length(seq_len, num_ranks) // (2 * num_ranks))
    return np.minimum(chunk_index, 2 * num_ranks - 1 - chunk_index)


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


def head_split(q_heads: int, kv_heads: int, num_ranks: int) -> list[HeadShare]:
    """Query heads cut into contiguous shares as even as `num_ranks` allows (sizes differ by at most
    one; empty when there are more ranks than heads). A query group whose heads fall on two ranks
    has its key head on both, as plain multi-head attention there: more bytes, never a wrong answer."""
    if num_ranks < 1 or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"cannot share {q_heads} query heads ({kv_heads} key heads) among {num_ranks} ranks")
    group = q_heads // kv_heads
    bounds = [q_heads * i // num_ranks for i in range(num_ranks + 1)]
    shares = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        whole = lo % group == 0 and hi % group == 0
        shares.append(HeadShare(lo, hi, range(lo // group, hi // group) if whole
                                else [h // group for h in range(lo, hi)]))
    return shares
