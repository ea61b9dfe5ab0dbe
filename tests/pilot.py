"""Driving the TUI under Textual's Pilot: waiting for the ranks, attaching documents, reading the screen."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from textual.command import CommandInput, CommandList, CommandPalette
from textual.pilot import Pilot
from textual.widget import Widget

from cpchat.tui.app import CpchatApp
from cpchat.tui.widgets import AttachmentChip, ChatInput, ChatMessage

SIZE = (140, 44)
RANKS = 2


async def until(pilot: Pilot, condition: Callable[[], object], timeout: float = 60.0, what: str = "") -> None:
    """Poll a condition with a deadline (the ranks run at their own pace)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.05)


async def click(pilot: Pilot, widget: Widget) -> None:
    """Click a widget once it is laid out where the click lands (a chip or a dialog's button just mounted,
    or one moved up by the removal of the one before it, has no place yet or a stale one)."""
    def placed() -> bool:
        region = widget.region
        return bool(region) and pilot.app.get_widget_at(region.x, region.y)[0] is widget

    await until(pilot, placed, what=f"{widget} laid out")
    assert await pilot.click(widget), f"the click missed {widget}"


async def run_palette(pilot: Pilot, title: str) -> None:
    """Ctrl+P, the entry's title searched for, and Enter once it is the first hit: the palette's own search
    and dispatch (the title is set in one go, not typed a key at a time: one search, not one a key)."""
    await pilot.press("ctrl+p")
    await until(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    pilot.app.screen.query_one(CommandInput).value = title
    commands = pilot.app.screen.query_one(CommandList)

    def first() -> str | None:
        option = commands.highlighted_option
        return option.hit.text if option is not None else None

    await until(pilot, lambda: first() == title, what=f"{title} first in the palette")
    await pilot.press("enter")
    await until(pilot, lambda: not isinstance(pilot.app.screen, CommandPalette), what="the palette to close")
    await pilot.pause()


async def ready(pilot: Pilot) -> CpchatApp:
    app = pilot.app
    await until(pilot, lambda: app.chat.backend.session is not None, what="the session")
    return app


def assistant_messages(app: CpchatApp) -> list[ChatMessage]:
    return [m for m in app.query(ChatMessage) if m.role == "assistant"]


def chips(app: CpchatApp) -> list[AttachmentChip]:
    return list(app.query(AttachmentChip))


async def attach_with_question(pilot: Pilot, doc: Path, question: str) -> None:
    """Paste a document's path (it becomes a chip once read) and type a question, not sent yet."""
    await paste(pilot, str(doc))
    await until(pilot, lambda: chips(pilot.app) and chips(pilot.app)[0].tokens, what="the chip")
    pilot.app.query_one(ChatInput).load_text(question)


async def paste(pilot: Pilot, text: str) -> None:
    """A bracketed paste as the terminal driver delivers it: to the app, which forwards it to the focus."""
    from textual import events

    pilot.app.query_one(ChatInput).focus()
    pilot.app.post_message(events.Paste(text))
    await pilot.pause()
