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


def label(stages: Stages) -> str:
    return "auto" if stages.auto else ",".join(map(str, stages.layers)) or str(stages.count)
