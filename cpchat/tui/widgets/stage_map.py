"""With --stages, the top of the Ranks panel: the ranks as a grid of P stages by C context ranks, a row
a stage (the layers it runs), a column a context rank (the tokens it holds), so which rank holds which
layers of which tokens reads at a glance."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from cpchat.tui.format import human_count
from cpchat.tui.widgets.rank_row import STATE_STYLES


@dataclass(frozen=True)
class StageCell:
    rank: int
    state: str
    kv_tokens: int


@dataclass(frozen=True)
class StageLine:
    first_layer: int
    end_layer: int
    cells: tuple[StageCell, ...]  # its context ranks, in ring order


class StageMap(Widget):
    """Renders the grid; hidden for one stage."""

    lines: reactive[tuple[StageLine, ...]] = reactive(())

    def watch_lines(self, lines: tuple[StageLine, ...]) -> None:
        self.display = len(lines) > 1

    def render(self) -> Text:
        text = Text.assemble(("layers tokens →", "dim"))
        for line in self.lines:
            last = line.end_layer - 1
            layers = f"{line.first_layer}–{last}" if last > line.first_layer else str(last)
            text.append("\n" + layers.ljust(7), "blue")
            for cell in line.cells:
                text.append(f"●{cell.rank} ", STATE_STYLES.get(cell.state, ""))
                text.append(human_count(cell.kv_tokens).ljust(6))
        return text
