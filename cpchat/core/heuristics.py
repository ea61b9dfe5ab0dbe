"""Choosing how a prefill's attention crosses the ranks, from a cost model over measured quantities.

The request: T new tokens after P cached ones, over N ranks; Hq / Hkv query / key-value heads of
size D (keys) and Dv (values), e bytes per K/V element, L layers. Measured on the cluster when it
forms: c, the seconds one rank spends on one query-key pair in all L layers together
(`PrefillCost.per_pair_s`); B, the bytes per second of one link; α, the latency of one small
message to a ring neighbour; α_x, that of one exchange (a small message to every other rank and
one from each, at once). Per layer:

    A = T (T + 1) / 2 + T P          query-key pairs of causal attention, all ranks together
    C = A c / (L N)                  one rank's attention compute
    K = (T + P) / N · Hkv (D + Dv) e one rank's keys and values
    Q = T / N · Hq D e               one rank's queries
    O = T / N · Hq (Dv + 1) · 4      one rank's partial outputs and log-sum-exps (float32)

    pass-KV     C/N + (N-1) · max(C/N, α + K/B)       N-1 hops; each send hides behind one block's compute
    pass-Q      C + N · (α + (Q + O)/B)               queries and running outputs go round, hop after hop
    all-gather  max(C/N, α_x + (N-1) K/B) + (N-1) C/N own block while every other block arrives at once
    Ulysses     u C + 2 α_x + (N-1)/N · (Q + Ku + O)/B two all-to-alls; u = ceil(Hq/N) N / Hq for an
                                                      uneven head split, Ku the K/V sent (Hkv heads, or
                                                      Hq when a query group is cut between ranks)

and a prefill's estimate is L times its layer. Moving bytes takes a CPU core too: where ranks
compute on every core of their host (CPU ranks, as many as the host has cores), nothing is left to
move them while they compute, and pass-KV's and all-gather's transfers add to their compute instead
of hiding behind it (`Measured.overlap` false): C + (N-1)(α + K/B) and C + α_x + (N-1) K/B.

Decode (one new token after a cache) exchanges only partial outputs, S = Hq (Dv + 1) · 4 bytes per
rank: over the ring (N-1)(α + S/B) per layer, in one exchange α_x + (N-1) S/B. Or rank 0 alone runs
the model (the lead step): the query out to every other rank and their partials back, α_x + (N-1)(Q1
+ S)/B with Q1 = Hq D e. It costs a message more than the exchange, but where every rank computes on
one machine's cores the others' copies of the weight products only take cores from rank 0's: there
the lead step is taken, unless some layer keeps a recurrent state that every rank must advance. Or
rank 0 holds every other rank's K/V for the answer (the gather step) and nothing crosses per layer;
only the new token's K/V go to the rank that keeps them, L Hkv (D + Dv) e bytes, off the step's path.
Its memory is one machine's too: where those K/V fit in GATHER_SHARE of rank 0's free memory, the
gather step is taken there instead of the lead step.

Meta's rule (arXiv 2411.01783, section 3) is this model restricted to pass-KV and pass-Q:
pass-KV when T/(T+P) ≥ 2 Hkv/Hq (then K ≤ Q, so every pass-KV hop costs less than a pass-Q one)
or when T is large enough that one block's transfer hides behind one block's compute (K/B ≤ C/N,
then pass-KV costs C, the least any algorithm can); with α = 0 the model picks pass-KV in both
cases (tests/test_heuristics.py checks it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

from cpchat.core.algorithms import DECODE_EXCHANGES, PREFILL_ALGORITHMS, title
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.core.sharding import Shares, head_split

GATHER_SHARE = 4  # a gather step's K/V from other ranks may take 1/GATHER_SHARE of rank 0's free memory


@dataclass(frozen=True)
class Workload:
    """One request's shape."""

    new_tokens: int
    cached_tokens: int
    ranks: int
    q_heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    bytes_per_element: int
    layers: int
    kv_format: KVFormat = FULL_PRECISION  # --kv-bits: K/V travel quantized past kv_format.start tokens
    states: bool = False  # some layers keep a recurrent state (linear attention) instead of K/V
    shares: Shares | None = None  # each rank's share of the new tokens (cpchat.core.sharding; None: equal)

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.cached_tokens < 0:
            raise ValueError(f"need new_tokens >= 1 and cached_tokens >= 0, got {self.new_tokens}, "
                             f"{self.cached_tokens}")
        if self.kv_heads < 1 or self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if min(self.ranks, self.head_dim, self.value_dim, self.bytes_per_element, self.layers) < 1:
            raise ValueError("ranks, head sizes, bytes_per_element and layers must be positive")


@dataclass(frozen=True)
class Measured:
    """The cluster's speeds, as its ranks measured them."""

    per_pair_s: float  # attention, one query-key pair, all layers, on the slowest rank
    link_bytes_per_s: float
    hop_latency_s: float  # one small message to a ring neighbour
    exchange_latency_s: float  # a small message to every other rank and one from each
    overlap: bool = True  # a core is free to move tensors while the ranks compute
    one_machine: bool = False  # every rank computes on the cores of one machine

    def __post_init__(self) -> None:
        if self.per_pair_s <= 0 or self.link_bytes_per_s <= 0:
            raise ValueError("per_pair_s and link_bytes_per_s must be positive")
        if self.hop_latency_s < 0 or self.exchange_latency_s < 0:
            raise ValueError("latencies cannot be negative")


@dataclass(frozen=True)
class Choice:
    algorithm: str
    estimates_s: dict[str, float]  # each candidate's estimated attention and transfer seconds
    reason: str


def prefill_estimates(w: Workload, m: Measured) -> dict[str, float]:
    """Seconds of attention and transfer each algorithm should take for this prefill (formulas above)."""
    n, t, p, b = w.ranks, w.new_tokens, w.cached_tokens, m.link_bytes_per_s
    compute = (t * (t + 1) / 2 + t * p) * m.per_pair_s / (w.layers * n)
    if n == 1:
        return dict.fromkeys(PREFILL_ALGORITHMS, compute * w.layers)  # nothing crosses
    kv_bytes = w.kv_format.bytes_per_element(w.bytes_per_element) if t + p > w.kv_format.start \
        else w.bytes_per_element
    kv = (t + p) / n * w.kv_heads * (w.head_dim + w.value_dim) * kv_bytes
    q = t / n * w.q_heads * w.head_dim * w.bytes_per_element
    out = t / n * w.q_heads * (w.value_dim + 1) * 4
    alpha, alpha_x = m.hop_latency_s, m.exchange_latency_s
    shares = head_split(w.q_heads, w.kv_heads, n)
    uneven = max(s.stop - s.start for s in shares) * n / w.q_heads
    kv_sent = kv if all(s.whole_groups for s in shares) else kv * w.q_heads / w.kv_heads
    hidden = max if m.overlap else operator.add  # a transfer beside compute: hidden, or added
    per_layer = {
        "pass_kv": compute / n + (n - 1) * hidden(compute / n, alpha + kv / b),
        "pass_q": compute + n * (alpha + (q + out) / b),
        "all_gather": hidden(compute / n, alpha_x + (n - 1) * kv / b) + (n - 1) * compute / n,
        "ulysses": uneven * compute + 2 * alpha_x + (n - 1) / n * (q + kv_sent + out) / b,
    }
    return {name: seconds * w.layers for name, seconds in per_layer.items()}


def transfer_seconds(w: Workload, m: Measured, algorithm: str) -> float:
    """What an algorithm's transfers add to its prefill: its estimate less the same over free links."""
    free = replace(m, link_bytes_per_s=1e15, hop_latency_s=0.0, exchange_latency_s=0.0)
    return prefill_estimates(w, m)[algorithm] - prefill_estimates(w, free)[algorithm]


def choose_algorithm(w: Workload, m: Measured, candidates: tuple[str, ...] = PREFILL_ALGORITHMS) -> Choice:
    """The candidate with the least estimated time (the first listed on a tie)."""
    estimates = {name: s for name, s in prefill_estimates(w, m).items() if name in candidates}
    if not estimates:
        raise ValueError(f"no known algorithm among {candidates}")
    best = min(estimates, key=estimates.get)
    if w.ranks == 1:
        return Choice(best, estimates, "one rank: nothing crosses")
    ranked = sorted(estimates, key=estimates.get)
    runner_up = f", {title(ranked[1])} {_ms(estimates[ranked[1]])}" if len(ranked) > 1 else ""
    busy = "" if m.overlap else " (no spare core: transfers add to compute)"
    return Choice(best, estimates, f"least estimated: {title(best)} {_ms(estimates[best])}{runner_up}{busy}")


def decode_estimates(w: Workload, m: Measured) -> dict[str, float]:
    """Seconds per decode token spent exchanging partial outputs: over the ring, in one exchange, or
    the lead's queries out and partials back."""
    n, size, query = w.ranks, w.q_heads * (w.value_dim + 1) * 4, w.q_heads * w.head_dim * w.bytes_per_element
    if n == 1:
        return dict.fromkeys(DECODE_EXCHANGES, 0.0)
    b = m.link_bytes_per_s
    return {
        "exchange": w.layers * (m.exchange_latency_s + (n - 1) * size / b),
        "ring": w.layers * (n - 1) * (m.hop_latency_s + size / b),
        "lead": w.layers * (m.exchange_latency_s + (n - 1) * (query + size) / b),
        "gather": 0.0,
    }


def choose_decode(w: Workload, m: Measured, copy_fits: bool = False) -> str:
    """How decode steps share the work: where every rank computes on one machine's cores (and no state
    needs every rank), the gather step if rank 0 can hold the other ranks' K/V (`copy_fits`), else the
    lead step; elsewhere whichever exchange of partial outputs is estimated faster (one exchange on a tie)."""
    if w.ranks > 1 and m.one_machine and not w.states:
        return "gather" if copy_fits else "lead"
    estimates = decode_estimates(w, m)
    return min(("exchange", "ring"), key=estimates.get)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds >= 0.0095 else f"{1000 * seconds:.1f} ms"
