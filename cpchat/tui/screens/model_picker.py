"""The model to switch every rank to: what is on this machine (cpchat.client.models), filtered as
the palette filters, or a path or hub id typed in full."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.fuzzy import Matcher
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from cpchat.client.models import LocalModel
from cpchat.format import human_bytes, human_params


def describe(model: LocalModel) -> str:
    """Architecture, size, form, context and bytes on disk, as far as they are known."""
    parts = [model.arch or "?", human_params(model.params), model.form or "?"]
    if model.context:
        parts.append(f"{model.context:,} ctx")
    if model.size_bytes:
        parts.append(human_bytes(model.size_bytes))
    return " · ".join(parts)


class ModelPicker(ModalScreen[str | None]):
    """Lists `find()`'s models (run in a thread worker: it reads every model's headers), those cpchat
    cannot run greyed with the reason. Enter takes the highlighted one, or the text typed when none
    matches or it names an existing path; dismisses with the model ("" for the demo) or None."""

    BINDINGS = [
        Binding("escape", "cancel", "Back"),
        Binding("down", "move(1)", "Next", show=False),
        Binding("up", "move(-1)", "Previous", show=False),
    ]

    def __init__(self, current: str, find: Callable[[], list[LocalModel]]) -> None:
        super().__init__()
        self.current, self._find = current, find
        self.models: list[LocalModel] | None = None  # None while looking
        self.shown: list[LocalModel] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="model-dialog"):
            yield Label(f"Switch every rank from {self.current} to (the conversation stays):")
            yield Input(placeholder="filter, or a model directory, ORG/NAME[@rev], FILE.gguf, ollama:NAME",
                        id="model-input")
            yield OptionList(id="model-list")
            yield Label("Looking for models on this machine…", id="model-status")

    def on_mount(self) -> None:
        self.query_one(Input).focus()
        self.look()

    @work(thread=True, exit_on_error=False)
    def look(self) -> None:
        models = self._find()
        self.app.call_from_thread(self._found, models)

    def _found(self, models: list[LocalModel]) -> None:
        self.models = models
        self._show(self.query_one(Input).value)

    def on_input_changed(self, event: Input.Changed) -> None:
        if self.models is not None:
            self._show(event.value)

    def _show(self, query: str) -> None:
        """The models matching `query`, best first (all of them, in order, for no query)."""
        assert self.models is not None
        matcher = Matcher(query) if query.strip() else None
        scored = [(matcher.match(m.label) if matcher else 1.0, i, m) for i, m in enumerate(self.models)]
        self.shown = [m for score, _, m in sorted(scored, key=lambda s: (-s[0], s[1])) if score > 0]
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options(self._option(m, matcher) for m in self.shown)
        options.highlighted = next((i for i, m in enumerate(self.shown) if m.runs), None)
        runnable = sum(m.runs for m in self.models)
        status = f"{len(self.models)} models here, {runnable} cpchat can run"
        if query.strip() and not self.shown:
            status = "No model here matches: Enter loads what you typed"
        self.query_one("#model-status", Label).update(status)

    def _option(self, model: LocalModel, matcher: Matcher | None) -> Option:
        running = model.name == self.current or model.path == self.current
        row = Content.assemble(
            matcher.highlight(model.label) if matcher else Content(model.label),
            (" (running)", "italic") if running else "",
            "  ", (describe(model), "dim"), "  ", (model.source, "dim italic"),
            ("" if model.runs else f"\n  cannot run: {model.problem}", "dim"),
        )
        return Option(row, disabled=not model.runs)

    def action_move(self, step: int) -> None:
        options = self.query_one(OptionList)
        options.action_cursor_down() if step > 0 else options.action_cursor_up()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        typed = event.value.strip()
        index = self.query_one(OptionList).highlighted
        if typed and (Path(typed).expanduser().exists() or index is None):
            self.dismiss(typed)
        elif index is not None:
            self.dismiss(self.shown[index].name)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.shown[event.option_index].name)

    def action_cancel(self) -> None:
        self.dismiss(None)
