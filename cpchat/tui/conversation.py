"""The conversation a chat screen shows: its entries in order, saved as they come (TranscriptStore),
exported as Markdown, or replaced by a saved one to go on with; and the chat screen's commands on it
(/clear, /export, /conversations), kept here beside it."""

from __future__ import annotations

from pathlib import Path

from textual import work

from cpchat.client.session import Message, Session
from cpchat.client.transcripts import Entry, TranscriptStore
from cpchat.dirs import data_dir
from cpchat.tui import messages as m
from cpchat.tui.export import export_transcript
from cpchat.tui.screens import ConversationsScreen


class Conversation:
    def __init__(self, directory: Path) -> None:
        self.entries: list[Entry] = []
        self.store = TranscriptStore(directory)

    def add(self, entry: Entry) -> None:
        """An entry on screen (the turn's worker saves it, as it streams)."""
        self.entries.append(entry)

    def as_sent(self) -> list[Message]:
        """The messages as the model saw them, for a session that goes on with them."""
        return [Message(e.role, e.content, e.docs) for e in self.entries]

    def clear(self) -> None:
        self.entries.clear()
        self.store.clear()

    def export(self, folder: Path) -> Path:
        """The conversation as a Markdown file in `folder`; OSError when it cannot be written."""
        return export_transcript(self.entries, folder)

    def open(self, path: Path) -> list[Entry]:
        """Go on with the saved conversation at `path` (OSError when it cannot be read): its entries."""
        self.entries = TranscriptStore.load(path)
        self.store.path = path
        return self.entries

    def go_on(self, session: Session) -> None:
        """Hand the conversation to `session`, whose ranks hold another or none: the next turn re-reads it."""
        session.messages = self.as_sent()
        session.attach(session.cluster)


class ConversationActions:
    """ChatScreen's commands on its conversation (a mixin: their workers and handlers run on the screen,
    which has the `conversation`, the `transcript` and the `backend` they use)."""

    def action_clear(self) -> None:
        if self._idle():
            self.reset_conversation()

    @work(thread=True, group="backend", exit_on_error=False)
    def reset_conversation(self) -> None:
        self.jobs.reset(self.failed)

    async def on_conversation_cleared(self, message: m.ConversationCleared) -> None:
        await self.transcript.clear()
        self.conversation.clear()
        self.side.clear()
        self.notify("Conversation cleared.")

    def action_export(self) -> Path | None:
        try:
            path = self.conversation.export(data_dir() / "exports")
        except OSError as e:
            self.notify(f"could not export: {e}", severity="error")
            return None
        self.notify(f"Transcript exported to {path}", timeout=8)
        return path

    def action_conversations(self) -> None:
        if self._idle():
            store = self.conversation.store
            self.app.push_screen(ConversationsScreen(store.directory, store.path),
                                 lambda path: path and self.open_conversation(path))

    @work(group="conversation", exclusive=True, exit_on_error=False)
    async def open_conversation(self, path: Path) -> None:
        """Show a saved conversation and go on with it: the next turn re-reads it on the ranks."""
        try:
            entries = self.conversation.open(path)
        except OSError as e:
            self.notify(f"cannot open {path.name}: {e.strerror}", severity="error")
            return
        await self.transcript.show(entries)
        session = self.backend.session
        if session is not None:
            self.conversation.go_on(session)
            self.announce_history_cost(path.stem, len(entries))
        else:
            self._opened = path.stem  # announced once the ranks are ready

    @work(thread=True, group="prepare", exit_on_error=False)
    def announce_history_cost(self, name: str, messages: int) -> None:
        self.jobs.announce_history_cost(name, messages)
