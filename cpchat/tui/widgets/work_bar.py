"""Progress of long work (loading the model, prefilling a long document), with an estimate."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import HorizontalGroup
from textual.widgets import Label, ProgressBar


class WorkBar(HorizontalGroup):
    """Hidden while idle. The estimate is the elapsed time scaled by what is left."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._started = 0.0
        self._phase = ""

    def compose(self) -> ComposeResult:
        yield Label("", id="work-label")
        yield ProgressBar(show_eta=False, show_percentage=True, id="work-progress")

    def show(self, phase: str, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != self._phase or done == 0:
            self._phase, self._started = phase, now
        estimate = ""
        if 0 < done < total:
            left = (now - self._started) / done * (total - done)
            estimate = f" · ~{left:.1f} s left"
        self.query_one("#work-label", Label).update(f"{label} {done}/{total}{estimate}")
        self.query_one("#work-progress", ProgressBar).update(total=max(total, 1), progress=done)
        self.display = True

    def hide(self) -> None:
        self._phase = ""
        self.display = False
