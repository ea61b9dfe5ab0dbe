"""The check before every prefill: can each rank hold what the prefill will allocate on it?
The need comes from cpchat.core.memory and the ranks' own measurements, the free memory from each
rank's Health report, asked just before the prefill is sent."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpchat.core.heuristics import Workload
from cpchat.core.memory import ForwardMemory, Need, kv_bytes_per_token, prefill_needs
from cpchat.core.quantized_kv import KVFormat
from cpchat.core.sharding import Shares, integer_shares
from cpchat.errors import BadInput
from cpchat.format import human_bytes

MAX_RANKS_SUGGESTED = 64


class MemoryShortfall(BadInput):
    """Some rank cannot hold the prefill: refused before any rank allocates."""

    def __init__(self, need: Need, label: str, suggestions: list[str], roomy: Shares | None = None) -> None:
        self.need, self.label, self.suggestions = need, label, suggestions
        self.roomy = roomy  # shares in proportion to the ranks' free memory, where those would hold it
        hint = ": " + "; ".join(suggestions) if suggestions else ""
        super().__init__(f"{label} needs {human_bytes(need.total)} for this prompt but has "
                         f"{human_bytes(need.free_bytes)} free{hint}")


@dataclass(frozen=True)
class StageSplit:
    """How the ranks split the model now (cpchat.core.stages): `stages` stages of all `ranks`, each
    rank holding `weight_bytes` of weights and its stage's `layers` (w.layers)."""

    stages: int
    ranks: int
    weight_bytes: int


def shortfall(w: Workload, algorithm: str, forward: list[ForwardMemory], free: list[int], answer_tokens: int,
              labels: list[str], split: StageSplit | None = None, draft_bytes: float = 0.0
              ) -> MemoryShortfall | None:
    """The first rank that cannot hold this prefill, with what would fit; None if every rank can. The
    first rank samples: it also holds a draft model's `draft_bytes` (--speculate draft:MODEL)."""
    needs = prefill_needs(w, algorithm, forward, free, answer_tokens, draft_bytes)
    short = next((n for n in needs if not n.fits), None)
    if short is None:
        return None

    def fits(workload: Workload, freed: float = 0.0) -> bool:
        n = workload.ranks  # more ranks like the one that is short
        needs = prefill_needs(workload, algorithm, [forward[short.rank]] * n, [free[short.rank] + freed] * n,
                              answer_tokens, short.draft_bytes)
        return all(x.fits for x in needs)

    suggestions = []
    if short.draft_bytes and short.total - short.draft_bytes <= short.free_bytes:
        suggestions.append(f"its draft model's K/V take {human_bytes(short.draft_bytes)}: --speculate lookup "
                           "would hold it")
    ranks = next((n for n in range(w.ranks + 1, MAX_RANKS_SUGGESTED + 1)
                  if fits(replace(w, ranks=n, shares=None))), None)
    if ranks:
        suggestions.append(f"{ranks} ranks like it would hold it")
    if split is not None:  # more stages of the same ranks: fewer layers' K/V and weights on each
        more = (p for p in range(split.stages + 1, split.ranks + 1) if split.ranks % p == 0)
        stages = next((p for p in more if fits(
            replace(w, ranks=split.ranks // p, layers=-(-w.layers * split.stages // p), shares=None),
            freed=split.weight_bytes * (1 - split.stages / p))), None)
        if stages:
            suggestions.append(f"--stages {stages} would hold it")
    if not w.kv_format.quantized and w.cached_tokens:  # the K/V held now would shrink
        quantized = replace(w, kv_format=KVFormat(4, 64, 0))
        freed = w.cached_tokens / w.ranks * (kv_bytes_per_token(w) - kv_bytes_per_token(quantized))
        if fits(quantized, freed):
            suggestions.append("--kv-bits 4 would hold it")
    roomy = None
    if w.ranks > 1:  # the same ranks, each given a share in proportion to its free memory
        most = max(max(free), 1)  # as fractions: integer_shares keeps integers (bytes) as given
        roomy = integer_shares([max(f, 1) / most for f in free], resolution=16)
        needs = prefill_needs(replace(w, shares=roomy), algorithm, forward, free, answer_tokens, draft_bytes)
        if roomy == w.shares or not all(x.fits for x in needs):
            roomy = None
        else:
            suggestions.append(f"--shares {','.join(map(str, roomy))} would hold it")

    def fits_now(tokens: int) -> bool:
        return all(x.fits for x in prefill_needs(replace(w, new_tokens=tokens), algorithm, forward, free,
                                                 answer_tokens, draft_bytes))

    low, high = 0, w.new_tokens - 1  # the longest prompt that fits now, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits_now(mid) else (low, mid - 1)
    if low:
        suggestions.append(f"a prompt of up to {low:,} new tokens fits")
    return MemoryShortfall(short, labels[short.rank], suggestions, roomy)
