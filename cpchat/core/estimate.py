"""How long a prefill will take, from what each rank measured when it loaded the model.

A rank's share of a prefill of T new tokens after P cached ones, over N ranks, is a forward of
T_r = padded(T)/N tokens (the weights' work, linear in tokens, plus a fixed cost per forward) and
attention of those queries over the keys before them. Attention runs in tiles (cpchat.core.attention):
a tile with no visible pair is skipped, every other one is computed whole, and one with some hidden
pair costs more a pair (its mask). So the pairs that count are the tiles' (`tile_pairs`), not the
causal ones: under head-tail sharding a rank's block of up to one tile reads every key block whole,
twice the visible pairs.

    seconds = fixed + per_token · T_r + per_pair · visible-tile pairs + per_masked_pair · masked-tile pairs

per_pair and per_masked_pair already sum over the model's layers; the busiest rank sets the time.
The ring's transfers are left out (cpchat.core.heuristics estimates them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpchat.core.attention import TILE
from cpchat.core.sharding import head_tail_layout, head_tail_positions


@dataclass(frozen=True)
class PrefillCost:
    fixed_s: float  # one forward, whatever its length
    per_token_s: float  # each token's share of the weights' work
    per_pair_s: float  # each (query, key) pair of a tile with every pair visible, all layers together
    step_s: float = 0.0  # a forward of one token a row (a decode step's products, before its attention)
    per_masked_pair_s: float = 0.0  # each pair of a tile where some pair is hidden (0: as per_pair_s)

    def seconds(self, new_tokens: int, cached_tokens: int, ranks: int, groups: int = 1) -> float:
        """The busiest rank's prefill; `groups` query heads share a key head (they set the key tiles)."""
        if new_tokens < 1:
            return self.fixed_s
        visible, masked = tile_pairs(new_tokens, cached_tokens, ranks, groups)
        local = len(head_tail_layout(new_tokens, ranks, 0).positions())
        return (self.fixed_s + self.per_token_s * local + self.per_pair_s * visible
                + (self.per_masked_pair_s or self.per_pair_s) * masked)


def tile_pairs(new_tokens: int, cached_tokens: int, ranks: int, groups: int = 1, tile: int = TILE
               ) -> tuple[int, int]:
    """(Pairs in wholly visible tiles, pairs in partly hidden ones) that the busiest rank computes in
    a prefill: its query tiles against the cached keys (all visible) and against each rank's block of
    new keys, tile by tile, as partial_attention cuts them (`groups` query heads a key head)."""
    blocks = [cached_tokens + np.array(head_tail_positions(new_tokens, ranks, r)) for r in range(ranks)]
    keys = np.concatenate(blocks)
    ends = np.cumsum([len(b) for b in blocks])
    tiled: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def key_tiles(k_tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """First and last position and size of every key tile, each rank's block cut on its own."""
        if k_tile not in tiled:
            cuts = [(a, min(a + k_tile, end)) for start, end in zip([0, *ends[:-1]], ends)
                    for a in range(start, end, k_tile)]
            starts, stops = np.array(cuts).T
            tiled[k_tile] = keys[starts], keys[stops - 1], stops - starts
        return tiled[k_tile]

    most = (0, 0)
    for rank in range(ranks):
        q = cached_tokens + np.array(head_tail_layout(new_tokens, ranks, rank).positions())
        visible, masked = cached_tokens * len(q), 0
        for q0 in range(0, len(q), tile):
            qt = q[q0:q0 + tile]
            first, last, size = key_tiles(max(tile, tile * tile // (groups * len(qt))))
            computed = first <= qt.max()  # not every key in every query's future
            hidden = last > qt.min()
            visible += len(qt) * int(size[computed & ~hidden].sum())
            masked += len(qt) * int(size[computed & hidden].sum())
        if visible + masked > sum(most):
            most = (visible, masked)
    return most


def line_through(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two timings, neither of them negative."""
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope
