"""--stages: how many pipeline stages the ranks form, and how many of the model's layers each runs
(the ranks do the split: cpchat/rank/stages.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stages:
    count: int = 1
    layers: tuple[int, ...] = ()  # layers per stage, as given; empty: an even split
    auto: bool = False  # the fewest stages whose ranks hold the weights (resolved once the ranks are known)


ONE_STAGE = Stages()


def parse_stages(text: str) -> Stages:
    """ "P", "auto", or layer counts "L1,L2,..." (one a stage)."""
    text = text.strip()
    if text == "auto":
        return Stages(auto=True)
    try:
        numbers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--stages {text!r}: expected a number of stages, auto, or layer counts "
                         "L1,L2,...") from None
    if min(numbers) < 1:
        raise ValueError(f"--stages {text!r}: stages and their layer counts are positive")
    if len(numbers) == 1:
        return Stages(numbers[0])
    return Stages(len(numbers), numbers)


def common_cuts(allowed: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The token counts linear layers' states can roll back to on every rank (or file): each rank's
    own, the empty ones allowing any (a stage without such layers); empty where all do."""
    constrained = [set(a) for a in allowed if a]
    return tuple(sorted(set.intersection(*constrained))) if constrained else ()


# A prompt through P stages goes in up to CHUNKS_PER_STAGE * P chunks of at least MIN_CHUNK tokens: while
# stage s runs chunk k, stage s + 1 runs chunk k - 1, and the stages wait (the pipeline's bubble) only
# while the first chunks fill the pipeline and the last ones drain it: about (P - 1) / (chunks + P - 1).
CHUNKS_PER_STAGE = 4
MIN_CHUNK = 256


def pipeline_cuts(start: int, end: int, stages: int) -> list[int]:
    """Where a prefill of positions [start, end) is cut into chunks for `stages` stages (none for one)."""
    if stages == 1:
        return []
    chunks = max(1, min(CHUNKS_PER_STAGE * stages, (end - start) // MIN_CHUNK))
    return [start + (end - start) * i // chunks for i in range(1, chunks)]


def pipeline_seconds(stage_seconds: list[float], chunks: int) -> float:
    """A prefill through stages that take `stage_seconds` each for the whole prompt, cut in `chunks`:
    the first chunk goes through every stage, and the slowest stage sets the pace of the others."""
    return sum(stage_seconds) / chunks + max(stage_seconds) * (chunks - 1) / chunks


# Of a rank's free memory, the share its weights may take under --stages auto: the rest is for the
# K/V of a prompt and the forward's activations (the memory check refuses a prompt that does not fit).
WEIGHT_SHARE = 0.75


def even_split(layers: int, stages: int) -> list[int]:
    """Layers per stage, the first stages one more where they do not divide."""
    base, extra = divmod(layers, stages)
    return [base + (s < extra) for s in range(stages)]


def speed_split(counts: list[int], stage_speeds: list[float]) -> list[int]:
    """Layers per stage in proportion to each stage's speed in layers a second (`counts` as loaded, for
    the total): the largest remainders take the layers left over, and a stage left none takes one
    from the stage with the most."""
    layers, total = sum(counts), sum(stage_speeds)
    shares = [layers * v / total for v in stage_speeds]
    split = [int(share) for share in shares]
    for s in sorted(range(len(split)), key=lambda s: int(shares[s]) - shares[s])[:layers - sum(split)]:
        split[s] += 1
    for s in range(len(split)):
        if split[s] == 0:
            split[split.index(max(split))] -= 1
            split[s] = 1
    return split


@dataclass(frozen=True)
class WeightParts:
    """The bytes of a model's weights: each layer's, the embedding's, and the rest's (the final norm,
    the head); from the lazily loaded arrays on a rank, from the files' headers on the front end."""

    layers: list[int]
    embedding: int
    rest: int
    tied: bool  # the head is the embedding

    def stage_bytes(self, first: int, end: int, stage: int, stages: int) -> int:
        """What a rank of stage `stage` running layers [first, end) holds: its layers, the embedding on
        the first stage (and on the last where the head is the embedding), the rest on the last."""
        last = stage == stages - 1
        embedding = stage == 0 or (last and self.tied)
        return sum(self.layers[first:end]) + self.embedding * embedding + self.rest * last

    def fits(self, counts: list[int], free: list[int]) -> bool:
        """Whether each stage's weights take at most WEIGHT_SHARE of its ranks' least `free` memory."""
        starts = [sum(counts[:s]) for s in range(len(counts))]
        return all(self.stage_bytes(a, a + n, s, len(counts)) <= WEIGHT_SHARE * f
                   for s, (a, n, f) in enumerate(zip(starts, counts, free, strict=True)))


def memory_split(parts: WeightParts, free: list[int]) -> list[int] | None:
    """Layers per stage for stages whose ranks have `free` memory (the least of each stage's): the even
    split where it fits, else each stage in turn as many layers as fit it, leaving one for each stage
    after it (None: no split fits)."""
    stages, layers = len(free), len(parts.layers)
    if stages > layers:
        return None
    even = even_split(layers, stages)
    if parts.fits(even, free):
        return even
    counts, first = [], 0
    for s in range(stages - 1):
        take = 1
        while (first + take < layers - (stages - s - 1)
               and parts.stage_bytes(first, first + take + 1, s, stages) <= WEIGHT_SHARE * free[s]):
            take += 1
        counts.append(take)
        first += take
    counts.append(layers - first)
    return counts if parts.fits(counts, free) else None
