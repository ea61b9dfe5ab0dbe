"""Progress of long work (loading the model, reading a document, prefilling), with an estimate."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import HorizontalGroup
from textual.widgets import Label, ProgressBar

from cpchat.format import human_duration

LABELS = {"download": "Downloading model, MiB", "convert": "Converting GGUF, tensors",
          "connect": "Starting ranks", "load": "Loading model on ranks", "prefill": "Prefill, tokens"}


class WorkBar(HorizontalGroup):
    """Hidden while idle. A prefill's estimate is the calibrated one counted down (its layers do not
    advance evenly in time, so extrapolating them misleads); other work extrapolates elapsed time."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._started = 0.0
        self._phase = ""
        self._shown: tuple[str, int, int, float | None] | None = None

    def compose(self) -> ComposeResult:
        yield Label("", id="work-label")
        yield ProgressBar(show_eta=False, show_percentage=True, id="work-progress")

    def on_mount(self) -> None:
        self.set_interval(1.0, self._tick)

    def progress(self, phase: str, done: int, total: int, label: str = "",
                 expected_s: float | None = None) -> None:
        """Work under way, labelled by its phase unless `label` names it; work that is over (nothing
        left to do, or no total) hides the bar, except a prefill's, which its result hides."""
        if total <= 0 or (phase != "prefill" and done >= total):
            self.hide()
        else:
            self.show(phase, label or LABELS.get(phase, phase), done, total, expected_s=expected_s)

    def show(self, phase: str, label: str, done: int, total: int, expected_s: float | None = None) -> None:
        if phase != self._phase:
            self._phase, self._started = phase, time.monotonic()
        self._shown = (label, done, total, expected_s)
        self._render_label()
        self.query_one("#work-progress", ProgressBar).update(total=max(total, 1), progress=done)
        self.display = True

    def _render_label(self) -> None:
        assert self._shown is not None
        label, done, total, expected_s = self._shown
        elapsed = time.monotonic() - self._started
        estimate = ""
        if expected_s is not None and expected_s >= 2:  # a shorter one is over before it can be read
            left = expected_s - elapsed
            estimate = (f" · about {human_duration(left)} left" if left >= 1
                        else f" · longer than the {human_duration(expected_s)} estimated")
        elif self._phase != "prefill" and 0 < done < total:
            estimate = f" · about {human_duration(elapsed / done * (total - done))} left"
        self.query_one("#work-label", Label).update(f"{label} {done:,}/{total:,}{estimate}")

    def _tick(self) -> None:
        if self.display and self._shown is not None:
            self._render_label()

    def hide(self) -> None:
        self._phase = ""
        self._shown = None
        self.display = False
