"""The Ranks panel: one row per rank, in ring order, scaled against the rank holding the most KV,
with each rank's measured speed and its share of the last prefill; with --stages, the stage map
above them."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import VerticalGroup
from textual.reactive import reactive

from cpchat.client.events import RankStats
from cpchat.tui.widgets.rank_row import RankRow
from cpchat.tui.widgets.stage_map import StageCell, StageLine, StageMap


def layer_words(first: int, end: int) -> str:
    return f"layers {first}–{end - 1}" if end - first > 1 else f"layer {first}"


class RanksPanel(VerticalGroup):
    """Keeps a RankRow per rank in ring order; fed with RankStats by the chat screen."""

    largest: reactive[tuple[int, int, int]] = reactive((0, 0, 0))  # ranks, the most KV tokens and bytes
    kv_bits: reactive[int] = reactive(0)  # K/V quantized to this many bits (--kv-bits), 0: not
    speeds: reactive[tuple[float, ...]] = reactive(())  # tokens/s each rank measured at load
    shares: reactive[tuple[int, ...]] = reactive(())  # the new tokens each rank took in the last prefill
    layers: reactive[tuple[tuple[int, int], ...]] = reactive(())  # each rank's layers [first, end)
    stages = 1  # pipeline stages of the ring: shares are of a stage's ranks, the same in every stage

    def watch_kv_bits(self, bits: int) -> None:
        self.border_subtitle = f"K/V {bits}-bit" if bits else ""

    def watch_speeds(self) -> None:
        self._share_out()

    def watch_shares(self) -> None:
        self._share_out()

    def watch_layers(self, layers: tuple[tuple[int, int], ...]) -> None:
        ring = max(len(self.rows) // self.stages, 1)
        for rank, row in self.rows.items():
            staged = self.stages > 1 and rank < len(layers)
            row.place = f"stage {rank // ring} · {layer_words(*layers[rank])}" if staged else ""
        self._map()

    def _map(self) -> None:
        """The stage map's grid: a line a stage, a cell a rank (its state and K/V tokens)."""
        ring, stats = max(len(self.rows) // self.stages, 1), [row.stats for row in self.rows.values()]
        if self.stages < 2 or len(self.layers) != len(stats):
            self.stage_map.lines = ()
            return
        self.stage_map.lines = tuple(
            StageLine(*self.layers[first], tuple(StageCell(s.rank, s.state, s.kv_tokens)
                                                 for s in stats[first:first + ring]))
            for first in range(0, len(stats), ring))

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
        self.stage_map = StageMap()

    def compose(self) -> ComposeResult:
        yield self.stage_map

    async def set_ranks(self, ranks: list[RankStats]) -> None:
        """Start over with these rows (a new ring); the old rows are gone when this returns."""
        await self.remove_children(RankRow)
        self.rows = {s.rank: RankRow(s) for s in ranks}
        await self.mount_all(self.rows.values())
        self.shares = ()
        self._share_out()
        self.watch_layers(self.layers)
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
        self._map()

    @property
    def total_kv_tokens(self) -> int:
        return sum(r.stats.kv_tokens for r in self.rows.values())
