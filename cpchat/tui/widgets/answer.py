"""The assistant's answer while it streams: it owns its Markdown stream, its text, and when its
tokens came (the Throughput panel turns that into rates)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from cpchat.tui.widgets.chat_message import ChatMessage


@dataclass(frozen=True)
class Pace:
    """How an answer's tokens came, as seen here, on the monotonic clock."""

    first_token_s: float  # from sending the prompt to the first token
    tokens: int
    decoding_s: float  # from the first token to the latest


class Answer(ChatMessage):
    """Shown empty when the prompt is sent; tokens stream in through `write`, and `finish` puts the
    whole text in place with how the turn ended."""

    def __init__(self) -> None:
        super().__init__("assistant", "")
        self.add_class("-streaming")
        self.text = ""
        self.tokens = 0
        self._stream: MarkdownStream | None = None
        self._sent_at = self._first_at = self._last_at = 0.0

    def start(self) -> None:
        """Once mounted: open the stream, and start the clock that TTFT is measured on."""
        self._stream = Markdown.get_stream(self)
        self._sent_at = time.monotonic()

    @property
    def pace(self) -> Pace:
        return Pace(self._first_at - self._sent_at, self.tokens, self._last_at - self._first_at)

    async def write(self, text: str, count: int) -> None:
        """`count` tokens arrived, making `text`."""
        now = time.monotonic()
        if not self.tokens:
            self._first_at = now
        self._last_at = now
        self.tokens += count
        self.text += text
        if self._stream is not None:
            await self._stream.write(text)

    async def finish(self, cancelled: bool, failed: bool) -> None:
        """The turn ended: the text as a whole replaces the stream, and the box says if it was stopped
        or interrupted (an empty answer says so, unless the turn failed)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.stop()
        self.remove_class("-streaming")
        await self.update(self.text or ("*(no answer)*" if not failed else ""))
        if cancelled:
            self.border_subtitle = "stopped"
        if failed:
            self.border_subtitle = "interrupted"
            self.add_class("-error")
