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


def fewest_stages(weight_bytes: int, free: list[int]) -> int:
    """The fewest stages (dividing the ranks) in which every rank's share of the weights fits in
    WEIGHT_SHARE of its free memory; all the ranks as stages when none does."""
    ranks = len(free)
    counts = [p for p in range(1, ranks + 1) if ranks % p == 0]
    return next((p for p in counts if weight_bytes / p <= WEIGHT_SHARE * min(free)), ranks)

