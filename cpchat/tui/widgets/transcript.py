"""The conversation on screen: one ChatMessage per message, kept scrolled to the end."""

from __future__ import annotations

from collections.abc import Iterable

from textual.containers import VerticalScroll

from cpchat.client.transcripts import Entry
from cpchat.tui.widgets.answer import Answer
from cpchat.tui.widgets.chat_message import ChatMessage


def shown(entry: Entry) -> ChatMessage:
    """A saved or sent message as the transcript shows it."""
    return ChatMessage(entry.role, entry.text or "*(documents only)*", entry.docs)


class Transcript(VerticalScroll):
    """Scrolls with the answer while the user is at the bottom (anchor), not when they scroll up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def show_turn(self, entry: Entry) -> Answer:
        """The user's message, and an empty answer that tokens will stream into."""
        answer = Answer()
        await self.mount_all([shown(entry), answer])
        answer.start()
        return answer

    async def show(self, entries: Iterable[Entry]) -> None:
        """These messages in place of those shown (a saved conversation opened)."""
        await self.remove_children()
        await self.mount_all(shown(e) for e in entries)
