"""The Throughput panel: time to first token, prefill and decode rates, context used."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.tui.format import bar, human_count


class ThroughputPanel(Widget):
    """Plain numbers, fed by the app from Prefill, Token and Done events and the rank stats."""

    ttft_ms: reactive[float | None] = reactive(None)
    prefill_tps: reactive[float | None] = reactive(None)
    decode_tps: reactive[float | None] = reactive(None)
    context_used: reactive[int] = reactive(0)
    context_max: reactive[int] = reactive(0)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Throughput"

    def render(self) -> Table:
        def num(value: float | None, unit: str, digits: int = 1) -> str:
            return "—" if value is None else f"{value:,.{digits}f} {unit}"

        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim")
        table.add_column()
        table.add_row("TTFT", num(self.ttft_ms, "ms"))
        table.add_row("prefill", num(self.prefill_tps, "tok/s", 0))
        table.add_row("decode", num(self.decode_tps, "tok/s"))
        fraction = self.context_used / self.context_max if self.context_max else 0.0
        context = Text(bar(fraction, 10), style="magenta")
        limit = human_count(self.context_max) if self.context_max else "—"
        context.append(f" {human_count(self.context_used)} / {limit}", style="default")
        table.add_row("context", context)
        return table
