"""The conversation: one Markdown widget per message, kept scrolled to the end."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown


class ChatMessage(Markdown):
    """A user or assistant message; `role` picks the style (see app.tcss)."""

    def __init__(self, role: str, markdown: str = "", docs: list[str] | None = None) -> None:
        super().__init__(markdown, classes=role)
        self.role = role
        self.border_title = {"user": "You", "assistant": "Assistant"}.get(role, role.title())
        if docs:
            self.border_subtitle = "attached: " + ", ".join(docs)


class Transcript(VerticalScroll):
    """Scrolls with the answer while the user is at the bottom (anchor), not when they scroll up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()
