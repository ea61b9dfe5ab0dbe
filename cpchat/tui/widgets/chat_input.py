"""The prompt: a multi-line TextArea where Enter sends and a drop of files attaches them."""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from cpchat.tui.paths import parse_dropped_paths


class ChatInput(TextArea):
    """Enter sends; ctrl+j (or shift+enter, where the terminal reports it) adds a newline;
    Up on the first line and Down on the last recall earlier prompts."""

    BINDINGS = [
        Binding("enter", "submit", "Send"),
        Binding("ctrl+j", "newline", "Newline", show=True),
    ]

    class Submitted(Message):
        """`attach_paths`: offer to attach the paths the text starts with (not when it was offered)."""

        def __init__(self, text: str, attach_paths: bool = True) -> None:
            super().__init__()
            self.text, self.attach_paths = text, attach_paths

    class PathsDropped(Message):
        """A paste made only of existing file paths: attach them instead of inserting text."""

        def __init__(self, paths: list[Path]) -> None:
            super().__init__()
            self.paths = paths

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False, **kwargs)
        self.prompts: list[str] = []
        self._recall: int | None = None  # index into history while browsing
        self._draft = ""

    def remember(self, text: str) -> None:
        if text.strip() and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._recall = None

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        self.insert("\n")

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        if key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if key in ("shift+enter", "ctrl+j", "alt+enter"):
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        row = self.cursor_location[0]
        if key == "up" and row == 0 and self.prompts:
            event.stop()
            event.prevent_default()
            if self._recall is None:
                self._draft, self._recall = self.text, len(self.prompts)
            self._recall = max(0, self._recall - 1)
            self._show(self.prompts[self._recall])
            return
        if key == "down" and self._recall is not None and row == self.document.line_count - 1:
            event.stop()
            event.prevent_default()
            self._recall += 1
            if self._recall >= len(self.prompts):
                self._recall = None
                self._show(self._draft)
            else:
                self._show(self.prompts[self._recall])
        # anything else falls through to TextArea._on_key (Textual dispatches along the MRO)

    async def _on_paste(self, event: events.Paste) -> None:
        paths = parse_dropped_paths(event.text)
        if paths:
            event.stop()
            event.prevent_default()
            self.post_message(self.PathsDropped(paths))
        # other pastes fall through to TextArea._on_paste, which inserts the text
