"""Head-tail ("zigzag") sharding of a sequence over N ranks.

The sequence is padded at its end to a multiple of 2N and cut into 2N equal
chunks; rank i holds chunks i and 2N-1-i. Under a causal mask, chunk c costs
about c+1 units of work, so every rank gets (i+1) + (2N-i) = 2N+1 units.
Padded positions (>= seq_len) are never returned as real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    chunk_index = position // (padded_length(seq_len, num_ranks) // (2 * num_ranks))
    return min(chunk_index, 2 * num_ranks - 1 - chunk_index)
