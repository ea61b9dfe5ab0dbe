"""`cpchat plan`: what a model and a context will need on each rank, and how fast they will run, before
any prompt is sent: from the ranks' own measurements when they loaded the model (the prefill's cost
and a forward's memory, cpchat.core.estimate and cpchat.core.memory) and what they report now (the
memory they hold and have free).

Per rank: the weights; the context's K/V; the peak (host memory on a CPU, MLX's on a GPU): what the
rank holds now (its weights and runtime) plus the prefill's need (activations, its new K/V, attention
tiles, the ring's blocks), or the peak it already reached loading the model, whichever is more. TTFT
is the prefill estimate (cpchat.core.estimate) and the chosen algorithm's transfers
(cpchat.core.heuristics). A decode step is the measured forward of one token a row, attention over
the rank's keys (every key, in a gather step), and the exchange of partials; the other ranks' K/V
a gather step holds add to rank 0's peak."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cpchat.client.events import RankStats
from cpchat.client.memory import shortfall
from cpchat.client.planner import Planner
from cpchat.core.estimate import rank_seconds
from cpchat.core.heuristics import decode_estimates, transfer_seconds
from cpchat.core.memory import gather_bytes, kv_bytes_per_token, prefill_needs
from cpchat.core.sharding import rank_tokens
from cpchat.format import human_bytes, human_duration


@dataclass(frozen=True)
class RankPlan:
    label: str
    weight_bytes: int
    kv_bytes: float
    peak_bytes: float
    need_bytes: float  # what the prefill allocates beyond what the rank holds now
    free_bytes: int
    tokens: int = 0  # its share of the context (--shares)

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes


@dataclass(frozen=True)
class Plan:
    context: int
    algorithm: str
    ranks: list[RankPlan]
    ttft_s: float | None
    decode_tokens_per_s: float | None
    refusal: str  # the memory check's line where some rank cannot hold the context, else ""
    max_context: int = 0  # the model's (0: unknown)


def make_plan(planner: Planner, context: int, answer_tokens: int) -> Plan:
    """The plan for a prompt of `context` tokens (and an answer of `answer_tokens`) on the planner's ranks."""
    cluster = planner.cluster
    w = planner.workload(context, 0)
    algorithm = planner.choose_algorithm(context, 0).algorithm
    free = cluster.free_memory()
    needs = prefill_needs(w, algorithm, cluster.forward_memory, free, answer_tokens)
    stats = cluster.stats_once()
    held = rank_tokens(context, cluster.size, w.shares)  # and each rank's share of the answer's
    answer = [n.answer_bytes / kv_bytes_per_token(w) for n in needs]
    ranks = [RankPlan(r.label, cluster.model.weight_bytes, (t + a) * kv_bytes_per_token(w),
                      _peak(r.computes_on_cpu, s, n.total), n.total, n.free_bytes, t)
             for r, s, n, t, a in zip(cluster.ranks, stats, needs, held, answer, strict=True)]
    decode_step = planner.decode_exchange(context, answer_tokens)
    if decode_step == "gather":  # rank 0 also holds every other rank's K/V while it answers
        copy = gather_bytes(w, context, answer_tokens)
        r0 = ranks[0]
        ranks[0] = replace(r0, peak_bytes=max(r0.peak_bytes, stats[0].rss_bytes + r0.kv_bytes + copy))
    cost = cluster.prefill_cost
    ttft = decode = None
    if cost is not None and cost.per_token_s:
        measured = planner.measured()
        ttft = max(rank_seconds(cluster.rank_costs, context, 0, cluster.model.groups, w.shares))
        ttft += transfer_seconds(w, measured, algorithm)
        attending = 1 if decode_step == "gather" else cluster.size  # ranks the keys are split between
        step = cost.step_s + cost.per_pair_s * context / attending
        step += decode_estimates(planner.workload(1, context), measured)[decode_step]
        decode = 1 / step
    labels = [r.label for r in cluster.ranks]
    refused = shortfall(w, algorithm, cluster.forward_memory, free, answer_tokens, labels)
    return Plan(context, algorithm, ranks, ttft, decode, str(refused) if refused else "",
                cluster.model.max_context)


def _peak(cpu: bool, stats: RankStats, need: float) -> float:
    """What a rank holds now plus the prefill's need, or the peak it reached already: in the host's
    memory on a CPU, in MLX's on a GPU."""
    if cpu:
        return max(stats.peak_rss_bytes, stats.rss_bytes + need)
    return max(stats.mlx_peak_bytes, stats.mlx_active_bytes + need)


def plan_lines(plan: Plan, model: str) -> list[str]:
    """The plan as `cpchat plan` prints it: a line per rank ("rank 0 ..."), then the times and the verdict."""
    lines = [f"{model}: {plan.context:,} tokens on {len(plan.ranks)} rank{'s' * (len(plan.ranks) > 1)} "
             f"({plan.algorithm})"]
    for r in plan.ranks:
        lines.append(f"{r.label}: {r.tokens:,} tokens, weights {human_bytes(r.weight_bytes)}, "
                     f"K/V {human_bytes(r.kv_bytes)}, "
                     f"peak {human_bytes(r.peak_bytes)}; the prefill needs {human_bytes(r.need_bytes)} of "
                     f"{human_bytes(r.free_bytes)} free: {'fits' if r.fits else 'does not fit'}")
    if plan.ttft_s is not None and plan.decode_tokens_per_s is not None:
        lines.append(f"time to first token about {human_duration(plan.ttft_s)}; decode about "
                     f"{plan.decode_tokens_per_s:.1f} tokens/s")
    if plan.max_context and plan.context + 1 > plan.max_context:
        lines.append(f"past the model's {plan.max_context:,}-token context: answers get unreliable there")
    lines.append(f"does not fit: {plan.refusal}" if plan.refusal else "fits on every rank")
    return lines
