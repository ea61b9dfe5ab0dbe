"""The side panels (Ranks, Ring, Throughput) as one column, so the chat screen hands each piece of
backend news to one place and each panel takes its share."""

from __future__ import annotations

from textual import getters
from textual.app import ComposeResult
from textual.containers import VerticalScroll

from cpchat.client.events import RankStats
from cpchat.tui.messages import BackendReady, PrefillDone
from cpchat.tui.widgets.ranks import RanksPanel
from cpchat.tui.widgets.ring import RingPanel, cache_words, pipeline_words
from cpchat.tui.widgets.throughput import ThroughputPanel


class SidePanels(VerticalScroll):
    """Collapsed to the status strip on narrow terminals (see app.tcss)."""

    ranks = getters.query_one(RanksPanel)
    ring = getters.query_one(RingPanel)
    throughput = getters.query_one(ThroughputPanel)

    def compose(self) -> ComposeResult:
        yield RanksPanel(id="ranks")
        yield RingPanel(id="ring")
        yield ThroughputPanel(id="throughput")

    async def show_ready(self, message: BackendReady) -> None:
        """A new ring, every rank ready with the model."""
        await self.ranks.set_ranks([RankStats(r.rank, r.address, "ready", blas=r.blas, slow_blas=r.slow_blas,
                                              threads=r.threads)
                                    for r in message.ranks])
        self.ranks.speeds = tuple(r.speed for r in message.ranks)
        self.ranks.stages = message.model.stages
        self.ranks.layers = tuple(r.layers for r in message.ranks)
        self.throughput.context_max = message.model.max_context
        self.ranks.kv_bits = message.model.kv_format.bits
        self.ring.transport = message.transport

    def show_stats(self, stats: RankStats) -> None:
        self.ranks.update_stats(stats)
        if stats.state == "failed":
            return
        if stats.ring_steps:
            self.ring.show_stats(stats)
        self.throughput.context_used = self.ranks.total_kv_tokens

    def show_prefill(self, message: PrefillDone) -> None:
        if message.choice is not None:
            self.ring.choice = message.choice
        self.ring.linear = message.prefill.linear_layers
        self.ring.cache = cache_words(message.prefill)
        self.ring.pipeline = pipeline_words(message.prefill, self.ranks.stages)
        self.ranks.shares = tuple(message.prefill.shares)
        self.throughput.prefill = message.prefill

    def clear(self) -> None:
        """A new conversation: no algorithm chosen yet, no rates."""
        self.ring.choice = None
        self.ring.cache = ""
        self.throughput.clear()
