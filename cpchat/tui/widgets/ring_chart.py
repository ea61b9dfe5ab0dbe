"""The last ring pass as a chart: per step, the time computing and the time waiting on the neighbour."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.client.events import RingStep
from cpchat.format import human_bytes

CHART_WIDTH = 16


def step_totals(steps: list[RingStep]) -> list[tuple[int, float, float, int]]:
    """(step, compute ms, wait ms, bytes) summed over layers and ranks, by step."""
    totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for s in steps:
        t = totals[s.step]
        t[0] += s.compute_ms
        t[1] += s.wait_ms
        t[2] += s.bytes_sent
    return [(step, t[0], t[1], int(t[2])) for step, t in sorted(totals.items())]


class RingChart(Widget):
    """Per-step stacked bars: compute (green) then waiting on the neighbour (yellow)."""

    steps: reactive[list[RingStep]] = reactive(list, always_update=True, layout=True)
    pass_name: reactive[str] = reactive("")

    def render(self) -> Text:
        totals = step_totals(self.steps)
        if not totals:
            if self.pass_name == "decode_gather":  # rank 0 decoded alone, on its copy of every rank's K/V
                return Text(f"last pass: {self.pass_name}: rank 0 alone, on a copy of every rank's K/V; "
                            "nothing crossed per layer", style="dim")
            return Text("no ring pass yet", style="dim")
        longest = max(c + w for _, c, w, _ in totals) or 1.0
        text = Text(f"last pass: {self.pass_name or '—'}  ", style="bold")
        text.append("█ compute ", "green")
        text.append("█ wait\n", "yellow")
        for step, compute, wait, _ in totals:
            c_cells = round(compute / longest * CHART_WIDTH)
            w_cells = round(wait / longest * CHART_WIDTH)
            text.append(f"step {step} ")
            text.append("█" * c_cells, "green")
            text.append("█" * w_cells, "yellow")
            text.append(" " * (CHART_WIDTH - c_cells - w_cells))
            text.append(f" {compute:.1f}/{wait:.1f} ms\n")
        moved = sum(b for *_, b in totals)
        text.append(f"moved {human_bytes(moved)} over the ring", "dim")
        return text
