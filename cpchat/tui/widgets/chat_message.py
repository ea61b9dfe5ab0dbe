"""One message of the conversation, the user's or the assistant's, as Markdown in a titled box."""

from __future__ import annotations

from textual.widgets import Markdown


class ChatMessage(Markdown):
    """A user or assistant message; `role` picks the style (see app.tcss)."""

    def __init__(self, role: str, markdown: str = "", docs: list[str] | None = None) -> None:
        super().__init__(markdown, classes=role)
        self.role = role
        self.border_title = {"user": "You", "assistant": "Assistant"}.get(role, role.title())
        if docs:
            self.border_subtitle = "attached: " + ", ".join(docs)
