"""The Ranks panel: one row per rank, in ring order, scaled against the rank holding the most KV,
with each rank's measured speed and its share of the last prefill."""

from __future__ import annotations

from dataclasses import replace

from textual.containers import VerticalGroup
from textual.reactive import reactive

from cpchat.client.events import RankStats
from cpchat.tui.widgets.rank_row import RankRow


class RanksPanel(VerticalGroup):
    """Keeps a RankRow per rank in ring order; fed with RankStats by the chat screen."""

    largest: reactive[tuple[int, int, int]] = reactive((0, 0, 0))  # ranks, the most KV tokens and bytes
    kv_bits: reactive[int] = reactive(0)  # K/V quantized to this many bits (--kv-bits), 0: not
    speeds: reactive[tuple[float, ...]] = reactive(())  # tokens/s each rank measured at load
    shares: reactive[tuple[int, ...]] = reactive(())  # the new tokens each rank took in the last prefill
    places: reactive[tuple[str, ...]] = reactive(())  # each rank's pipeline stage and layers ("": one stage)
    stages = 1  # pipeline stages of the ring: shares are of a stage's ranks, the same in every stage

    def watch_kv_bits(self, bits: int) -> None:
        self.border_subtitle = f"K/V {bits}-bit" if bits else ""

    def watch_speeds(self) -> None:
        self._share_out()

    def watch_shares(self) -> None:
        self._share_out()

    def watch_places(self, places: tuple[str, ...]) -> None:
        for rank, row in self.rows.items():
            row.place = places[rank] if rank < len(places) else ""

    def _share_out(self) -> None:
        total = sum(self.shares)
        for rank, row in self.rows.items():
            row.speed = self.speeds[rank] if rank < len(self.speeds) else 0.0
            share = self.shares[rank % len(self.shares)] if self.shares else 0
            row.share = share / total if total and rank < self.stages * len(self.shares) else None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Ranks"
        self.rows: dict[int, RankRow] = {}

    async def set_ranks(self, ranks: list[RankStats]) -> None:
        """Start over with these rows (a new ring); the old rows are gone when this returns."""
        await self.remove_children()
        self.rows = {s.rank: RankRow(s) for s in ranks}
        await self.mount_all(self.rows.values())
        self.shares = ()
        self._share_out()
        self.watch_places(self.places)
        self._rescale()

    def update_stats(self, stats: RankStats) -> None:
        row = self.rows.get(stats.rank)
        if row is None:
            row = self.rows[stats.rank] = RankRow(stats)
            self.mount(row)
        else:
            row.stats = stats
        self._rescale()

    def mark(self, state: str, error: str = "", ranks: list[int] | None = None) -> None:
        """Set the state of some (or all) rows without new stats, e.g. after a failure."""
        for rank, row in self.rows.items():
            if ranks is None or rank in ranks:
                row.stats = replace(row.stats, state=state, error=error or row.stats.error)

    def _rescale(self) -> None:
        largest = max((r.stats.kv_bytes for r in self.rows.values()), default=0)
        for row in self.rows.values():
            row.largest_kv = largest
        tokens = max((r.stats.kv_tokens for r in self.rows.values()), default=0)
        self.largest = (len(self.rows), tokens, largest)

    @property
    def total_kv_tokens(self) -> int:
        return sum(r.stats.kv_tokens for r in self.rows.values())
