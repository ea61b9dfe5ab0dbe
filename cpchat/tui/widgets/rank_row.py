"""One rank in the Ranks panel: state, its pipeline stage and layers (with --stages), KV held (a bar
against the largest), the recurrent state of linear-attention layers (models that have them), its
speed and share of the last prefill, memory and BLAS."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.client.events import RankStats
from cpchat.format import human_bytes
from cpchat.tui.format import bar, human_count

STATE_STYLES = {
    "starting": "dim",
    "loading": "yellow",
    "ready": "green",
    "idle": "green",
    "busy": "bold cyan",
    "failed": "bold red",
}
BAR_WIDTH = 12


class RankRow(Widget):
    """Renders one RankStats; `largest_kv` (bytes) scales the bar across rows."""

    stats: reactive[RankStats] = reactive(RankStats(0, "", "starting"))
    largest_kv: reactive[int] = reactive(0)
    speed: reactive[float] = reactive(0.0)  # tokens/s of its forward, measured at load (0: unknown)
    share: reactive[float | None] = reactive(None)  # its part of the last prefill's new tokens
    place: reactive[str] = reactive("")  # its pipeline stage and layers ("": every layer)

    def __init__(self, stats: RankStats) -> None:
        super().__init__(classes="rank-row")
        self.set_reactive(RankRow.stats, stats)

    def watch_stats(self, stats: RankStats) -> None:
        self.set_class(stats.state == "failed", "-failed")
        self.tooltip = stats.error or None

    def render(self) -> Text:
        s = self.stats
        style = STATE_STYLES.get(s.state, "")
        head = [(f"● {s.rank} ", style), (s.address or "—", "bold"), "  ", (s.state, style), "\n"]
        text = Text.assemble(*head)
        if self.place:
            text.append(self.place + "\n", "blue")
        fraction = s.kv_bytes / self.largest_kv if self.largest_kv else 0.0
        kv = f" {human_count(s.kv_tokens)} tok {human_bytes(s.kv_bytes)}\n"
        text.append_text(Text.assemble("KV ", (bar(fraction, BAR_WIDTH), "magenta"), kv))
        if s.state_bytes:  # linear-attention layers: one recurrent state, the same on every rank
            text.append(f"state {human_bytes(s.state_bytes)}\n", "cyan")
        if self.speed or self.share is not None:
            speed = f"{human_count(round(self.speed))} tok/s" if self.speed else ""
            share = f"share {self.share:.0%}" if self.share is not None else ""
            text.append(" · ".join(p for p in (share, speed) if p) + "\n", "green")
        if s.state == "failed" and s.error:
            text.append(s.error, "red")
        else:
            text.append(f"RSS {human_bytes(s.rss_bytes)}  MLX {human_bytes(s.mlx_active_bytes)}"
                        f" (peak {human_bytes(s.mlx_peak_bytes)})", "dim")
        if s.blas:
            slow = " (slow)" if s.slow_blas else ""
            threads = f", {s.threads} thread{'s' if s.threads != 1 else ''}" if s.threads else ""
            text.append(f"\nBLAS: {s.blas}{threads}{slow}", "yellow" if s.slow_blas else "dim")
        return text
