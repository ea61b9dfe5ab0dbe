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
from cpchat.client.planner import Planner
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
    draft_bytes: float = 0.0  # a draft model's weights and K/V (--speculate draft:MODEL; the rank samples)

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


def make_plan(planner: Planner, context: int, answer_tokens: int, draft_model: str = "") -> Plan:
    """The plan for a prompt of `context` tokens (and an answer of `answer_tokens`) on the planner's ranks:
    each pipeline stage's ranks hold the K/V of their stage's layers, and the rank that samples a draft
    model's weights and K/V (loaded there first)."""
    cluster = planner.cluster
    algorithm = planner.choose_algorithm(context, 0).algorithm
    decode_step = planner.decode_exchange(context, answer_tokens)
    draft = cluster.load_draft(draft_model) if draft_model else None
    draft_kv = draft.need(context + answer_tokens) if draft else 0
    sampler = cluster.stage_ranks(cluster.stages - 1)[0]
    free = cluster.free_memory()
    stats = cluster.stats_once()
    ranks = []
    for stage in range(cluster.stages):
        members = cluster.stage_ranks(stage)
        w = planner.stage_workload(stage, context, 0)
        needs = prefill_needs(w, algorithm, [cluster.forward_memory[i] for i in members],
                              [free[i] for i in members], answer_tokens,
                              draft_kv if sampler in members else 0)
        held = rank_tokens(context, cluster.ring_size, w.shares)  # and each rank's share of the answer's
        for i, n, t in zip(members, needs, held, strict=True):
            r, answer = cluster.ranks[i], n.answer_bytes / kv_bytes_per_token(w)
            plan = RankPlan(r.label, r.weight_bytes or cluster.model.weight_bytes,
                            (t + answer) * kv_bytes_per_token(w), _peak(r.computes_on_cpu, stats[i], n.total),
                            n.total, n.free_bytes, t,
                            (draft.weight_bytes + draft_kv) if draft and i == sampler else 0)
            if decode_step == "gather" and i == members[0]:  # it also holds its stage's other ranks' K/V
                copy = stats[i].rss_bytes + plan.kv_bytes + gather_bytes(w, context, answer_tokens)
                plan = replace(plan, peak_bytes=max(plan.peak_bytes, copy))
            ranks.append(plan)
    ttft = decode = None
    seconds = planner.prefill_seconds(context, 0)
    if seconds is not None:
        measured = planner.measured()
        ttft = seconds + transfer_seconds(planner.workload(context, 0), measured, algorithm)
        attending = 1 if decode_step == "gather" else cluster.ring_size  # ranks the keys are split between
        step = sum(max(cluster.rank_costs[i].step_s + cluster.rank_costs[i].per_pair_s * context / attending
                       for i in cluster.stage_ranks(s)) for s in range(cluster.stages))  # one after another
        step += decode_estimates(planner.workload(1, context), measured)[decode_step]
        step += (cluster.stages - 1) * cluster.hop_latency_s  # each stage hands the token's hidden state on
        decode = 1 / step
    refused = planner.memory_shortfall(context, 0, algorithm, answer_tokens, draft_model)
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
        draft = f"draft model {human_bytes(r.draft_bytes)}, " if r.draft_bytes else ""
        lines.append(f"{r.label}: {r.tokens:,} tokens, weights {human_bytes(r.weight_bytes)}, "
                     f"K/V {human_bytes(r.kv_bytes)}, {draft}peak {human_bytes(r.peak_bytes)}; "
                     f"the prefill needs {human_bytes(r.need_bytes)} of "
                     f"{human_bytes(r.free_bytes)} free: {'fits' if r.fits else 'does not fit'}")
    if plan.ttft_s is not None and plan.decode_tokens_per_s is not None:
        lines.append(f"time to first token about {human_duration(plan.ttft_s)}; decode about "
                     f"{plan.decode_tokens_per_s:.1f} tokens/s")
    if plan.max_context and plan.context + 1 > plan.max_context:
        lines.append(f"past the model's {plan.max_context:,}-token context: answers get unreliable there")
    lines.append(f"does not fit: {plan.refusal}" if plan.refusal else "fits on every rank")
    return lines
