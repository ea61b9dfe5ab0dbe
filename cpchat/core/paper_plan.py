"""`cpchat plan --paper`: what a model and a context would take on hosts that are not here, from the
model's shapes alone: each host's stage, layers, tokens, weights and K/V, and the fewest stages that
hold it. Nothing is measured, so no speeds and no activations: a host holds its part when its weights
and K/V take at most PAPER_SHARE of its memory, the rest left for the forward's activations and the
runtime, which the ranks measure when they load (`cpchat plan` without --paper)."""

from __future__ import annotations

from dataclasses import dataclass

from cpchat.core.sharding import rank_tokens
from cpchat.core.stages import Stages, WeightParts, even_split, memory_split

PAPER_SHARE = 0.85


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys and values: bytes a token, and the most tokens it keeps (0: every one)."""

    bytes_per_token: float
    window: int = 0


@dataclass(frozen=True)
class PaperModel:
    weights: WeightParts
    kv: list[LayerKV]  # a layer each (0 bytes: a layer with a recurrent state, not K/V)


@dataclass(frozen=True)
class PaperHost:
    stage: int
    layers: tuple[int, int]  # [first, end)
    tokens: int
    weight_bytes: int
    kv_bytes: float
    memory_bytes: int

    @property
    def holds(self) -> bool:
        return self.weight_bytes + self.kv_bytes <= PAPER_SHARE * self.memory_bytes


@dataclass(frozen=True)
class PaperPlan:
    context: int
    stages: int
    hosts: list[PaperHost]

    @property
    def holds(self) -> bool:
        return all(h.holds for h in self.hosts)


def kv_bytes(model: PaperModel, first: int, end: int, tokens: int, context: int) -> float:
    """The K/V a rank holding `tokens` of a `context`-token prompt keeps of layers [first, end): a
    windowed layer keeps at most its window of the whole context, each rank its part of that."""
    return sum(layer.bytes_per_token * (tokens if not layer.window or layer.window >= context
                                        else tokens * layer.window / context)
               for layer in model.kv[first:end])


def stage_plan(model: PaperModel, memory: list[int], context: int, counts: list[int]) -> PaperPlan:
    """The plan of `len(counts)` stages running `counts` layers each, on hosts of `memory` bytes in ring
    order (a stage's hosts consecutive), the context shared out equally within each stage."""
    stages = len(counts)
    ring = len(memory) // stages
    held = rank_tokens(context, ring)
    hosts = []
    for r, host_memory in enumerate(memory):
        s = r // ring
        first = sum(counts[:s])
        end = first + counts[s]
        tokens = held[r % ring]
        hosts.append(PaperHost(s, (first, end), tokens, model.weights.stage_bytes(first, end, s, stages),
                               kv_bytes(model, first, end, tokens, context), host_memory))
    return PaperPlan(context, stages, hosts)


def paper_plan(model: PaperModel, memory: list[int], context: int, stages: Stages) -> PaperPlan | None:
    """The plan for `stages` (auto: the fewest stages, dividing the hosts, whose every host holds its
    part, else the most). None: `stages` cannot split this model's layers over these hosts."""
    layers, hosts = len(model.kv), len(memory)
    if stages.auto:  # as --stages auto splits them when the ranks load
        splits = [_memory_split(model, memory, p) for p in range(1, min(hosts, layers) + 1) if hosts % p == 0]
    elif hosts % stages.count or stages.count > layers or (stages.layers and sum(stages.layers) != layers):
        splits = []
    else:
        splits = [list(stages.layers) or even_split(layers, stages.count)]
    plans = [stage_plan(model, memory, context, split) for split in splits]
    if stages.auto:
        return next((plan for plan in plans if plan.holds), plans[-1] if plans else None)
    return plans[0] if plans else None


def _memory_split(model: PaperModel, memory: list[int], stages: int) -> list[int]:
    """--stages auto's split of the layers for these stages' hosts, else an even one."""
    ring = len(memory) // stages
    least = [min(memory[s * ring:(s + 1) * ring]) for s in range(stages)]
    return memory_split(model.weights, least) or even_split(len(model.kv), stages)
