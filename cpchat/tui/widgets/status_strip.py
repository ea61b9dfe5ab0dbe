"""The one-line status strip that stands in for the side panels when they are collapsed."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.core.algorithms import title
from cpchat.format import human_bytes
from cpchat.tui.format import human_count
from cpchat.tui.widgets.ranks import RanksPanel
from cpchat.tui.widgets.ring import RingPanel
from cpchat.tui.widgets.throughput import ThroughputPanel


class StatusStrip(Widget):
    """ranks · KV per rank · algorithm · TTFT · tok/s, read from the panels it stands in for."""

    ranks: reactive[int] = reactive(0)
    kv_tokens: reactive[int] = reactive(0)  # the largest rank's
    kv_bytes: reactive[int] = reactive(0)
    algorithm: reactive[str] = reactive("")
    ttft_ms: reactive[float | None] = reactive(None)
    decode_tps: reactive[float | None] = reactive(None)
    cache: reactive[str] = reactive("")  # the Ring panel's words on the last prefill's cached tokens

    def on_mount(self) -> None:
        screen = self.screen
        ranks, ring, throughput = (screen.query_one(RanksPanel), screen.query_one(RingPanel),
                                   screen.query_one(ThroughputPanel))
        self.watch(ranks, "largest", self._ranks_changed)
        self.watch(ring, "shown", lambda name: setattr(self, "algorithm", name))
        self.watch(ring, "cache", lambda words: setattr(self, "cache", words))
        self.watch(throughput, "ttft_ms", lambda v: setattr(self, "ttft_ms", v))
        self.watch(throughput, "decode_tps", lambda v: setattr(self, "decode_tps", v))

    def _ranks_changed(self, largest: tuple[int, int, int]) -> None:
        self.ranks, self.kv_tokens, self.kv_bytes = largest

    def render(self) -> Text:
        ttft = "—" if self.ttft_ms is None else f"{self.ttft_ms / 1000:.1f} s"
        rate = "—" if self.decode_tps is None else f"{self.decode_tps:.1f} tok/s"
        parts = [
            f"{self.ranks} ranks" if self.ranks != 1 else "1 rank",
            f"KV {human_count(self.kv_tokens)} tok {human_bytes(self.kv_bytes)}/rank",
            title(self.algorithm),
            f"TTFT {ttft}",
            rate,
        ]
        if "disk" in self.cache:
            parts.append(self.cache.removeprefix("cache: "))
        text = Text(" · ".join(parts))
        text.append("  ctrl+b panels", style="dim")
        return text
