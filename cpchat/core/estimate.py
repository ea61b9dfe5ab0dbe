"""How long a prefill will take, from what each rank measured when it loaded the model.

A rank's share of a prefill of T new tokens after P cached ones, over N ranks, is a forward of its
T_r tokens (padded(T)/N for equal shares; the weights' work, linear in tokens, plus a fixed cost per
forward) and attention of those queries over the keys before them. Attention runs in tiles
(cpchat.core.attention): a tile with no visible pair is skipped, every other one is computed whole,
and one with some hidden pair costs more a pair (its mask). So the pairs that count are the tiles'
(`rank_pairs`), not the causal ones; tiles are cut where a rank's head and tail chunks meet
(cpchat.core.attention.tile_bounds), and the count cuts them alike.

    seconds = fixed + per_token · T_r + per_pair · visible-tile pairs + per_masked_pair · masked-tile pairs

per_pair and per_masked_pair already sum over the model's layers; the busiest rank sets the time.
The ring's transfers are left out (cpchat.core.heuristics estimates them). Ranks of different speeds
get shares that even their times out (`balanced_shares`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np

from cpchat.core.attention import TILE, tile_bounds
from cpchat.core.sharding import Shares, head_tail_layout, head_tail_positions, integer_shares

# Auto shares stay equal unless the cost model expects uneven ones to be this much faster: the
# calibration of equally fast ranks differs by a few per cent from run to run.
UNEVEN_GAIN = 1.10


@dataclass(frozen=True)
class PrefillCost:
    fixed_s: float  # one forward, whatever its length
    per_token_s: float  # each token's share of the weights' work
    per_pair_s: float  # each (query, key) pair of a tile with every pair visible, all layers together
    step_s: float = 0.0  # a forward of one token a row (a decode step's products, before its attention)
    per_masked_pair_s: float = 0.0  # each pair of a tile where some pair is hidden (0: as per_pair_s)

    def seconds(self, new_tokens: int, cached_tokens: int, ranks: int, groups: int = 1,
                shares: Shares | None = None) -> float:
        """The busiest rank's prefill, every rank at this cost; `groups` query heads share a key head
        (they set the key tiles)."""
        return max(rank_seconds([self] * ranks, new_tokens, cached_tokens, groups, shares))

    def scaled(self, factor: float) -> PrefillCost:
        """Every time `factor` times as long (a rank that shares its cores)."""
        return PrefillCost(*(factor * seconds for seconds in astuple(self)))

    def query_s(self, keys: int) -> float:
        """What one more query adds to a forward over `keys` keys held: its share of the weights' work
        and its attention (a speculative check's cost a proposed token)."""
        return self.per_token_s + self.per_pair_s * keys

    def rank_seconds(self, tokens: int, pairs: tuple[int, int]) -> float:
        """A rank's prefill of `tokens` queries that compute `pairs` (rank_pairs') in its tiles."""
        visible, masked = pairs
        return (self.fixed_s + self.per_token_s * tokens + self.per_pair_s * visible
                + (self.per_masked_pair_s or self.per_pair_s) * masked)


def rank_seconds(costs: Sequence[PrefillCost], new_tokens: int, cached_tokens: int, groups: int = 1,
                 shares: Shares | None = None) -> list[float]:
    """Each rank's prefill, rank i at costs[i] with its share of the new tokens."""
    ranks = len(costs)
    if new_tokens < 1:
        return [c.fixed_s for c in costs]
    pairs = rank_pairs(new_tokens, cached_tokens, ranks, groups, shares)
    tokens = [2 * head_tail_layout(new_tokens, ranks, r, shares).chunk for r in range(ranks)]
    return [c.rank_seconds(t, p) for c, t, p in zip(costs, tokens, pairs, strict=True)]


def balanced_shares(costs: Sequence[PrefillCost], new_tokens: int, cached_tokens: int, groups: int = 1
                    ) -> Shares | None:
    """Shares that even out the ranks' prefill times (None: equal ones). A rank's two chunks read
    pairs in proportion to their length (cpchat.core.sharding), so the first guess is each rank's
    speed at this prompt's mean keys a query; two corrections from the tile-level estimate follow,
    and uneven shares are taken only when expected UNEVEN_GAIN faster than equal ones."""
    if len(costs) < 2 or new_tokens < 2 * len(costs):
        return None
    keys = cached_tokens + new_tokens / 2
    weights = [1 / max(c.per_token_s + c.per_pair_s * keys, 1e-12) for c in costs]
    best, best_s = None, max(rank_seconds(costs, new_tokens, cached_tokens, groups)) / UNEVEN_GAIN
    for _ in range(3):
        shares = integer_shares(weights)
        times = rank_seconds(costs, new_tokens, cached_tokens, groups, shares)
        if max(times) < best_s:
            best, best_s = shares, max(times)
        weights = [w * sum(times) / len(times) / t for w, t in zip(weights, times, strict=True)]
    return best


def rank_pairs(new_tokens: int, cached_tokens: int, ranks: int, groups: int = 1, shares: Shares | None = None,
               tile: int = TILE) -> list[tuple[int, int]]:
    """(Pairs in wholly visible tiles, pairs in partly hidden ones) that each rank computes in a
    prefill: its query tiles against the cached keys (all visible) and against each rank's block of
    new keys, tile by tile, as partial_attention cuts them (`groups` query heads a key head)."""
    blocks = [cached_tokens + np.array(head_tail_positions(new_tokens, ranks, r, shares))
              for r in range(ranks)]
    tiled: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def key_tiles(k_tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """First and last position and size of every key tile, each rank's block cut on its own."""
        if k_tile not in tiled:
            cuts = [(b[k0], b[k1 - 1], k1 - k0) for b in blocks for k0, k1 in tile_bounds(b, k_tile)]
            tiled[k_tile] = tuple(np.array(c) for c in zip(*cuts, strict=True))
        return tiled[k_tile]

    pairs = []
    for rank in range(ranks):
        q = cached_tokens + np.array(head_tail_layout(new_tokens, ranks, rank, shares).positions())
        visible, masked = cached_tokens * len(q), 0
        for q0, q1 in tile_bounds(q, tile):
            qt = q[q0:q1]
            first, last, size = key_tiles(max(tile, tile * tile // (groups * len(qt))))
            computed = first <= qt.max()  # not every key in every query's future
            hidden = last > qt.min()
            visible += len(qt) * int(size[computed & ~hidden].sum())
            masked += len(qt) * int(size[computed & hidden].sum())
        pairs.append((visible, masked))
    return pairs


def line_through(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two timings, neither of them negative."""
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope
