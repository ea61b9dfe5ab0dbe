"""The chat's one command table: every command is reachable as /name and in the palette, and each
really does its thing, through Pilot: the dialog it opens, the state it changes, the file it writes,
or the backend work it starts (recorded here: no ranks run in these tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from pilot import SIZE, run_palette, until
from textual.pilot import Pilot
from textual.widgets import Input, Markdown

from cpchat.client.settings import Settings
from cpchat.client.transcripts import Entry
from cpchat.dirs import data_dir
from cpchat.tui.app import CpchatApp
from cpchat.tui.chat import ChatScreen
from cpchat.tui.commands import BY_NAME, COMMANDS, parse_slash
from cpchat.tui.messages import TokensArrived, TurnFinished
from cpchat.tui.screens import AttachmentsScreen, ConversationsScreen, FilePicker, HelpScreen, ModelPicker
from cpchat.tui.widgets import AttachmentChip, ChatInput, ChatMessage, RingPanel

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_slash_commands_parse_with_and_without_their_argument():
    assert parse_slash("/model acme/tiny-chat") == (BY_NAME["model"], "acme/tiny-chat")
    assert parse_slash("/attach  'a b.pdf' c.txt ") == (BY_NAME["attach"], "'a b.pdf' c.txt")
    assert parse_slash("/clear") == (BY_NAME["clear"], "")
    assert parse_slash("/nosuch thing") is None  # sent as a prompt
    assert parse_slash("clear") is None


class RecordingChat(ChatScreen):
    """The chat with a stand-in for loaded ranks: the backend work a command starts is recorded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started: list[tuple[str, ...]] = []
        self.backend.cluster = SimpleNamespace(model=SimpleNamespace(name="acme/tiny-chat"), is_local=True)

    def relaunch(self) -> None:  # the worker
        self.started.append(("relaunch",))

    def switch_model(self, model: str) -> None:  # the worker
        self.started.append(("switch_model", model))


class RecordingApp(CpchatApp):
    CHAT_SCREEN = RecordingChat


# How a command is given: `run(name, argument, title)` types `/name argument`, or picks the palette's
# entry `title` (the palette takes no argument: the action asks for it, or the entry carries it).
Run = Callable[[str, str, str], Awaitable[None]]


def slash(pilot: Pilot) -> Run:
    async def run(name: str, argument: str, title: str) -> None:
        prompt = pilot.app.query_one(ChatInput)
        prompt.load_text(f"/{name} {argument}".strip())
        prompt.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert prompt.text == "" and pilot.app.chat.turns_done == 0  # run, not sent as a prompt

    return run


def palette(pilot: Pilot) -> Run:
    async def run(name: str, argument: str, title: str) -> None:
        await run_palette(pilot, title)

    return run


async def on_top(pilot: Pilot, screen: type) -> None:
    """The command opened `screen`; Esc closes it again."""
    await until(pilot, lambda: isinstance(pilot.app.screen, screen), what=screen.__name__)
    await pilot.press("escape")
    await until(pilot, lambda: pilot.app.screen is pilot.app.chat, what="the chat again")


def notified(app: CpchatApp, text: str) -> bool:
    return any(text in n.message for n in app._notifications)


async def answered(pilot: Pilot) -> None:
    """A conversation of one turn on screen, as the backend's messages make it."""
    chat = pilot.app.chat
    await chat.show_turn(Entry("user", "Where is Orion?"))
    chat.post_message(TokensArrived("In the winter sky.", 1))
    chat.post_message(TurnFinished())
    await until(pilot, lambda: not chat.busy and len(chat.conversation.entries) == 2, what="the turn's end")


# What each command must do, given either way.

async def attach(pilot: Pilot, run: Run, document: Path) -> None:
    await run("attach", f"'{document}'", "Attach file")
    if isinstance(pilot.app.screen, FilePicker):  # from the palette it asks which
        path = pilot.app.screen.query_one("#picker-path", Input)
        path.value = str(document)
        path.focus()
        await pilot.press("enter")
    await until(pilot, lambda: [c.path for c in pilot.app.query(AttachmentChip)] == [document.resolve()],
                what="the chip")


async def attachments(pilot: Pilot, run: Run, document: Path) -> None:
    await run("attachments", "", "List attachments")
    await until(pilot, lambda: isinstance(pilot.app.screen, AttachmentsScreen), what="the list")
    assert document.name in pilot.app.screen.query_one(Markdown).source
    await on_top(pilot, AttachmentsScreen)


async def conversations(pilot: Pilot, run: Run, document: Path) -> None:
    await run("conversations", "", "Conversations")
    await on_top(pilot, ConversationsScreen)


async def model(pilot: Pilot, run: Run, document: Path) -> None:
    chat = pilot.app.chat
    await run("model", "acme/other-chat", "Switch model")
    if isinstance(pilot.app.screen, ModelPicker):  # from the palette it asks which
        await pilot.press(*"acme/other-chat", "enter")
    await until(pilot, lambda: chat.started == [("switch_model", "acme/other-chat")], what="the switch")
    assert chat.busy  # until the ranks say they switched
    chat.busy = False
    chat.started.clear()


async def algorithm(pilot: Pilot, run: Run, document: Path) -> None:
    await run("algorithm", "pass_q", "Algorithm: pass_q")
    await until(pilot, lambda: pilot.app.query_one(RingPanel).mode == "pass_q", what="the ring's mode")
    assert pilot.app.chat.settings.algorithm == "pass_q" and notified(pilot.app, "Ring algorithm: pass_q")


async def clear(pilot: Pilot, run: Run, document: Path) -> None:
    await answered(pilot)
    await run("clear", "", "Clear conversation")
    await until(pilot, lambda: not pilot.app.query(ChatMessage), what="an empty transcript")
    assert pilot.app.chat.conversation.entries == [] and notified(pilot.app, "Conversation cleared.")


async def export(pilot: Pilot, run: Run, document: Path) -> None:
    await answered(pilot)
    exports = data_dir() / "exports"
    before = {p: p.stat().st_mtime_ns for p in exports.glob("*.md")}
    await run("export", "", "Export transcript")
    written = [p for p in exports.glob("*.md") if before.get(p) != p.stat().st_mtime_ns]
    assert len(written) == 1 and "In the winter sky." in written[0].read_text()


async def relaunch(pilot: Pilot, run: Run, document: Path) -> None:
    chat = pilot.app.chat
    await run("relaunch", "", "Relaunch ranks")  # Ctrl+R shows once a rank failed; the command always runs
    await until(pilot, lambda: chat.started == [("relaunch",)], what="the relaunch")
    chat.started.clear()


async def help(pilot: Pilot, run: Run, document: Path) -> None:
    await run("help", "", "Show help")
    await on_top(pilot, HelpScreen)


CASES = {case.__name__: case for case in (attach, attachments, conversations, model, algorithm, clear, export,
                                          relaunch, help)}


def test_every_command_has_a_case():
    assert set(CASES) == {c.name for c in COMMANDS}


@pytest.mark.slow
@pytest.mark.parametrize("route", [slash, palette])
async def test_every_command_runs_its_action(tmp_path, route):
    document = tmp_path / "orion notes.txt"
    document.write_text("Orion is a winter constellation.\n")
    app = RecordingApp(Settings(), start_backend=False, transcripts=tmp_path / "transcripts")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        run = route(pilot)
        for command in COMMANDS:
            await CASES[command.name](pilot, run, document)
