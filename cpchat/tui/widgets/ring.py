"""The Ring panel: the algorithm in large type, why auto chose it, and the last ring pass as a chart."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalGroup
from textual.reactive import reactive
from textual.widgets import Static

from cpchat.client.events import AlgorithmChoice, Prefill, RankStats, RingStep
from cpchat.core.algorithms import title
from cpchat.format import human_bytes
from cpchat.tui.format import human_count
from cpchat.tui.widgets.big_text import BigText
from cpchat.tui.widgets.ring_chart import RingChart

# The algorithm in words, for screen readers, copies and logs of the screen (the letters are glyphs).
ALGORITHM_WORDS = {
    "pass_kv": "keys and values travel the ring",
    "pass_q": "queries travel the ring",
    "all_gather": "every rank's keys and values reach all ranks at once",
    "ulysses": "each rank takes some heads over the whole sequence",
    "auto": "the least estimated time, per turn",
}


class RingPanel(VerticalGroup):
    """`mode` is the session's setting; `choice` the last prefill's decision; `transport` how tensors
    travel between the ranks; the chart shows the last pass, as the ranks' stats report it."""

    mode: reactive[str] = reactive("auto")
    transport: reactive[str] = reactive("")
    choice: reactive[AlgorithmChoice | None] = reactive(None)
    linear: reactive[str] = reactive("")  # how the last prefill ran the linear-attention layers, if any
    cache: reactive[str] = reactive("")  # where the last prefill's cached tokens came from, if any
    pipeline: reactive[str] = reactive("")  # how long the last prefill's stages waited for each other
    shown: reactive[str] = reactive("auto")  # the algorithm the panel names

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Ring"
        self._rank_steps: dict[int, list[RingStep]] = {}  # each rank's part of the last pass

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

    def watch_cache(self) -> None:
        self._refresh_text()

    def watch_pipeline(self) -> None:
        self._refresh_text()

    def show_stats(self, stats: RankStats) -> None:
        """A rank's share of the last ring pass: the chart shows every rank's latest share."""
        self._rank_steps[stats.rank] = stats.ring_steps
        self.show_pass(stats.algorithm, [s for steps in self._rank_steps.values() for s in steps])

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
        if self.cache:
            reason.append(f"\n{self.cache}", "green")
        if self.linear:
            reason.append(f"\n{self.linear}", "italic")
        if self.pipeline:
            reason.append(f"\n{self.pipeline}", "blue")
        self.query_one("#ring-reason", Static).update(reason)


def pipeline_words(prefill: Prefill, stages: int) -> str:
    """The pipeline's bubble in the last prefill: how long the stages after the first waited for the
    one before ("" for one stage)."""
    waits = prefill.stage_wait_ms
    if stages < 2 or not waits or not prefill.ms:
        return ""
    ring = len(waits) // stages
    waited = max(waits[ring:])
    return f"{stages} stages: waited up to {waited:,.0f} ms ({waited / prefill.ms:.0%} of the prefill)"


def cache_words(prefill: Prefill) -> str:
    """Where the prefill's cached tokens came from, for the panel ("" when none were)."""
    if prefill.cache == "disk":
        seconds = prefill.load_ms / 1000
        return f"cache: {human_count(prefill.reused_tokens)} tok loaded from disk in {seconds:.1f} s"
    if prefill.cache == "memory":
        return f"cache: {human_count(prefill.reused_tokens)} tok held in memory"
    return ""
