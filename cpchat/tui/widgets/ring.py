"""The Ring panel: the algorithm in large type, why auto chose it, and the last ring pass as a chart."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalGroup
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from cpchat.client.events import AlgorithmChoice, RingStep
from cpchat.core.algorithms import title
from cpchat.tui.format import human_bytes

# A three-row block font for the few letters the algorithm names need.
GLYPHS = {
    "P": ("┏━┓", "┣━┛", "╹  "),
    "A": ("┏━┓", "┣━┫", "╹ ╹"),
    "S": ("┏━╸", "┗━┓", "╺━┛"),
    "K": ("╻┏╸", "┣┻┓", "╹ ╹"),
    "V": ("╻  ╻", "┗┓┏┛", " ┗┛ "),
    "Q": ("┏━┓", "┃ ┃", "┗━╋"),
    "U": ("╻ ╻", "┃ ┃", "┗━┛"),
    "T": ("╺┳╸", " ┃ ", " ╹ "),
    "O": ("┏━┓", "┃ ┃", "┗━┛"),
    "L": ("╻  ", "┃  ", "┗━╸"),
    "G": ("┏━╸", "┃╺┓", "┗━┛"),
    "H": ("╻ ╻", "┣━┫", "╹ ╹"),
    "E": ("┏━╸", "┣╸ ", "┗━╸"),
    "R": ("┏━┓", "┣┳┛", "╹┗╸"),
    "Y": ("╻ ╻", "┗┳┛", " ╹ "),
    "-": ("   ", "╺━╸", "   "),
    " ": ("   ", "   ", "   "),
}
CHART_WIDTH = 16
# The algorithm in words, for screen readers, copies and logs of the screen (the letters are glyphs).
ALGORITHM_WORDS = {
    "pass_kv": "keys and values travel the ring",
    "pass_q": "queries travel the ring",
    "all_gather": "every rank's keys and values reach all ranks at once",
    "ulysses": "each rank takes some heads over the whole sequence",
    "auto": "the least estimated time, per turn",
}


class BigText(Widget):
    """A word in three-row block letters (unknown letters become blanks)."""

    text: reactive[str] = reactive("")

    def render(self) -> Text:
        word = self.text.upper().replace("_", "-")
        rows = [" ".join(GLYPHS.get(ch, GLYPHS[" "])[i] for ch in word) for i in range(3)]
        return Text("\n".join(rows), style="bold")


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


class RingPanel(VerticalGroup):
    """`mode` is the session's setting; `choice` the last prefill's decision; `transport` how tensors
    travel between the ranks; `steps` the last pass."""

    mode: reactive[str] = reactive("auto")
    transport: reactive[str] = reactive("")
    choice: reactive[AlgorithmChoice | None] = reactive(None)
    linear: reactive[str] = reactive("")  # how the last prefill ran the linear-attention layers, if any
    shown: reactive[str] = reactive("auto")  # the algorithm the panel names

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Ring"

    def compose(self) -> ComposeResult:
        yield BigText(id="ring-algorithm")
        yield Static(id="ring-words")
        yield Static(id="ring-reason")
        yield RingChart(id="ring-chart")

    def on_mount(self) -> None:
        self._refresh_text()

    def watch_mode(self) -> None:
        self._refresh_text()

    def watch_choice(self) -> None:
        self._refresh_text()

    def watch_transport(self) -> None:
        self._refresh_text()

    def watch_linear(self) -> None:
        self._refresh_text()

    def show_pass(self, pass_name: str, steps: list[RingStep]) -> None:
        charts = self.query(RingChart)
        if not charts:  # not composed yet, or being torn down: stats may arrive at any time
            return
        chart = charts.first()
        chart.pass_name = pass_name
        chart.steps = steps

    def _refresh_text(self) -> None:
        if not self.children:  # not composed yet; on_mount comes back
            return
        choice = self.choice
        big = choice.algorithm if choice else self.mode
        self.query_one(BigText).text = big
        self.shown = big
        words = Text(f"{title(big)}: ", style="bold")
        words.append(ALGORITHM_WORDS.get(big, ""))
        self.query_one("#ring-words", Static).update(words)
        self.border_subtitle = f"mode {self.mode}" + (f" · {self.transport}" if self.transport else "")
        reason = Text()
        if choice is None:
            reason.append("chosen per turn" if self.mode == "auto" else "forced", "dim")
        elif choice.forced:
            reason.append(choice.reason, "dim")
        else:
            reason.append(f"T {choice.new_tokens} new · P {choice.cached_tokens} cached"
                          f" · miss {choice.miss_rate:.2f}\n")
            estimates = [f"{title(name)} {ms:,.0f}" for name, ms in choice.estimates_ms.items()]
            for i in range(0, len(estimates), 2):  # two a line: the panel is narrow
                reason.append(("est " if i == 0 else "    ") + " · ".join(estimates[i:i + 2]) + " ms\n")
            if choice.hop_latency_ms:
                link = human_bytes(choice.link_bytes_per_s)
                reason.append(f"link {link}/s · hop {choice.hop_latency_ms:.1f}"
                              f" · exch {choice.exchange_latency_ms:.1f} ms", "dim")
        if self.linear:
            reason.append(f"\n{self.linear}", "italic")
        self.query_one("#ring-reason", Static).update(reason)
