"""One attached document above the prompt: name, format, pages or files, token count, and × to remove."""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.app import ComposeResult
from textual.containers import HorizontalGroup
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Button, Label

from cpchat.client.documents import Document
from cpchat.format import human_bytes
from cpchat.tui.format import human_count


class AttachmentChip(HorizontalGroup):
    """One attached document; `tokens` is None until the tokenizer has counted it."""

    tokens: reactive[int | None] = reactive(None)

    class Remove(Message):
        def __init__(self, chip: AttachmentChip) -> None:
            super().__init__()
            self.chip = chip

    class Show(Message):
        """The chip was clicked: show what the document holds."""

        def __init__(self, chip: AttachmentChip) -> None:
            super().__init__()
            self.chip = chip

    def __init__(self, path: Path, document: Document, tokens: int | None = None) -> None:
        super().__init__(classes="chip")
        self.path, self.document = path, document
        self.set_reactive(AttachmentChip.tokens, tokens)

    def compose(self) -> ComposeResult:
        yield Label(self._caption(), classes="chip-label")
        yield Button("×", compact=True, classes="chip-remove", tooltip=f"Remove {self.document.name}")

    def _caption(self) -> str:
        d = self.document
        tokens = "… tok" if self.tokens is None else f"{human_count(self.tokens)} tok"
        if d.kind == "folder":
            return f"{d.name}/ · {d.files} file{'s' * (d.files != 1)} · {tokens}"
        detail = f"{d.pages} {d.unit}" if d.pages else human_bytes(d.size)
        return f"{d.name} · {d.kind} · {detail} · {tokens}"

    def on_click(self, event: events.Click) -> None:
        if not isinstance(event.widget, Button):
            self.post_message(self.Show(self))

    def watch_tokens(self) -> None:
        if self.is_mounted:
            self.query_one(".chip-label", Label).update(self._caption())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(self.Remove(self))
