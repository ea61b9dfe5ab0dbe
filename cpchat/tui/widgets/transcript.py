"""The conversation on screen: one ChatMessage per message, kept scrolled to the end, and the
welcome while there is none."""

from __future__ import annotations

from collections.abc import Iterable

from textual import getters
from textual.app import ComposeResult
from textual.containers import VerticalScroll

from cpchat.client.transcripts import Entry
from cpchat.tui.widgets.answer import Answer
from cpchat.tui.widgets.chat_message import ChatMessage
from cpchat.tui.widgets.welcome import Welcome


def shown(entry: Entry) -> ChatMessage:
    """A saved or sent message as the transcript shows it."""
    return ChatMessage(entry.role, entry.text or "*(documents only)*", entry.docs)


class Transcript(VerticalScroll):
    """Scrolls with the answer while the user is at the bottom (anchor), not when they scroll up."""

    can_focus = False
    welcome = getters.query_one(Welcome)

    def compose(self) -> ComposeResult:
        yield Welcome()

    def on_mount(self) -> None:
        self.anchor()

    async def show_turn(self, entry: Entry) -> Answer:
        """The user's message, and an empty answer that tokens will stream into."""
        self.welcome.display = False
        answer = Answer()
        await self.mount_all([shown(entry), answer])
        answer.start()
        return answer

    async def show(self, entries: Iterable[Entry]) -> None:
        """These messages in place of those shown (a saved conversation opened)."""
        await self.clear()
        messages = [shown(e) for e in entries]
        await self.mount_all(messages)
        self.welcome.display = not messages

    async def clear(self) -> None:
        """No message: the welcome again."""
        await self.query(ChatMessage).remove()
        self.welcome.display = True
