"""How long a prefill will take, from what each rank measured when it loaded the model.

A rank's share of a prefill of T new tokens after P cached ones, over N ranks, is a forward of
T/N tokens (the weights' work, linear in tokens, plus a fixed cost per forward) and attention of
those T/N queries over the keys before them: P + T/2 on average with causal masking, since
head-tail sharding gives every rank an equal share of early and late queries.

    seconds = fixed + per_token · T/N + per_pair · (T/N) · (P + T/2)

per_pair already sums over the model's layers. The ring's transfers run behind the compute
(pass-KV) and are left out: on a fast link they hide, on a slow one the estimate is low.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCost:
    fixed_s: float  # one forward, whatever its length
    per_token_s: float  # each token's share of the weights' work
    per_pair_s: float  # each (query, key) pair of attention, all layers together

    def seconds(self, new_tokens: int, cached_tokens: int, ranks: int) -> float:
        local = new_tokens / max(ranks, 1)
        pairs = local * (cached_tokens + new_tokens / 2)
        return self.fixed_s + self.per_token_s * local + self.per_pair_s * pairs


def line_through(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(intercept, slope) of the line through two timings, neither of them negative."""
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope

