"""The Throughput panel: time to first token, prefill and decode rates, speculation, context used."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.client.events import Done, Prefill, Speculated
from cpchat.tui.format import bar, human_count
from cpchat.tui.widgets.answer import Pace


class ThroughputPanel(Widget):
    """Computes its own rates from what the chat screen hands down: the prefill's result (`prefill`),
    the answer's pace as seen here while it streams (`pace`), and the client's figures when the turn
    is done (`done`), which replace those seen here. The rates themselves can be set as well."""

    prefill: reactive[Prefill | None] = reactive(None, always_update=True)
    pace: reactive[Pace | None] = reactive(None, always_update=True)
    done: reactive[Done | None] = reactive(None, always_update=True)

    ttft_ms: reactive[float | None] = reactive(None)
    prefill_tps: reactive[float | None] = reactive(None)
    decode_tps: reactive[float | None] = reactive(None)
    speculation: reactive[Speculated | None] = reactive(None)
    context_used: reactive[int] = reactive(0)
    context_max: reactive[int] = reactive(0)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Throughput"

    def watch_prefill(self, prefill: Prefill | None) -> None:
        if prefill is not None and prefill.ms > 0:
            self.prefill_tps = prefill.new_tokens / (prefill.ms / 1000)

    def watch_pace(self, pace: Pace | None) -> None:
        """Time to first token as seen here, and the decode rate since the first token."""
        if pace is None:
            return
        self.ttft_ms = 1000 * pace.first_token_s
        if pace.tokens > 1 and pace.decoding_s > 0:
            self.decode_tps = (pace.tokens - 1) / pace.decoding_s

    def watch_done(self, done: Done | None) -> None:
        if done is None:
            return
        self.ttft_ms = done.ttft_ms
        if done.decode_tokens_per_s:
            self.decode_tps = done.decode_tokens_per_s
        self.context_used = sum(r.kv_tokens for r in done.ranks)
        self.speculation = done.speculation if done.speculation.steps else None

    def clear(self) -> None:
        """A new conversation: no rates until its first turn."""
        self.ttft_ms = self.prefill_tps = self.decode_tps = self.speculation = None

    def render(self) -> Table:
        def num(value: float | None, unit: str, digits: int = 1) -> str:
            return "—" if value is None else f"{value:,.{digits}f} {unit}"

        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim")
        table.add_column()
        table.add_row("TTFT", num(self.ttft_ms, "ms"))
        table.add_row("prefill", num(self.prefill_tps, "tok/s", 0))
        table.add_row("decode", num(self.decode_tps, "tok/s"))
        if (s := self.speculation) is not None:  # tokens a step: what each step gives, one without proposals
            taken = f"{s.accepted / s.proposed:.0%} taken" if s.proposed else "none proposed"
            table.add_row(s.mode, f"{(s.steps + s.accepted) / s.steps:.1f} tok/step, {taken}")
        fraction = self.context_used / self.context_max if self.context_max else 0.0
        context = Text(bar(fraction, 10), style="magenta")
        limit = human_count(self.context_max) if self.context_max else "—"
        context.append(f" {human_count(self.context_used)} / {limit}", style="default")
        table.add_row("context", context)
        return table
