"""The saved conversations (/conversations): open, rename or delete one."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from cpchat.client.conversations import (
    ConversationSummary,
    delete_conversation,
    list_conversations,
    rename_conversation,
)
from cpchat.tui.format import human_count


class ConversationsScreen(ModalScreen[Path | None]):
    """The saved conversations, newest first: Enter opens one (dismisses with its file), R renames,
    D deletes (not the open one), Esc goes back."""

    BINDINGS = [Binding("escape", "cancel", "Back"), Binding("r", "rename", "Rename"),
                Binding("d", "delete", "Delete")]

    def __init__(self, directory: Path, current: Path | None) -> None:
        super().__init__()
        self.directory, self.current = directory, current
        self.summaries: list[ConversationSummary] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-dialog"):
            yield Label("Conversations — Enter open · R rename · D delete · Esc back")
            yield OptionList(id="conversations-list")
            yield Input(placeholder="new title (empty: the first message)", id="conversations-title")

    def on_mount(self) -> None:
        self.query_one("#conversations-title", Input).display = False
        self.refresh_list()

    def refresh_list(self) -> None:
        self.summaries = list_conversations(self.directory)
        options = self.query_one(OptionList)
        highlighted = options.highlighted
        options.clear_options()
        for s in self.summaries:
            tokens = ("~" if s.tokens_estimated else "") + human_count(s.tokens)
            line = Text(s.title, style="bold" if s.path != self.current else "bold green")
            line.append(f"\n{s.updated:%Y-%m-%d %H:%M} · {s.model or 'model not recorded'} · {tokens} tok · "
                        f"{s.messages} messages · {s.id}", style="dim")
            options.add_option(Option(line, id=s.id))
        if not self.summaries:
            options.add_option(Option(f"no saved conversations in {self.directory}", disabled=True))
        else:
            options.highlighted = min(highlighted or 0, len(self.summaries) - 1)
        options.focus()

    def _selected(self) -> ConversationSummary | None:
        index = self.query_one(OptionList).highlighted
        return self.summaries[index] if index is not None and index < len(self.summaries) else None

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        chosen = self._selected()
        if chosen is not None and not chosen.error:
            self.dismiss(chosen.path)

    def action_rename(self) -> None:
        chosen = self._selected()
        if chosen is None:
            return
        title = self.query_one("#conversations-title", Input)
        title.value, title.display = chosen.title, True
        title.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        chosen = self._selected()
        event.input.display = False
        if chosen is not None:
            rename_conversation(self.directory, chosen.id, event.value)
        self.refresh_list()

    def action_delete(self) -> None:
        chosen = self._selected()
        if chosen is None:
            return
        if chosen.path == self.current:
            self.notify("That conversation is open: /clear starts a new one.", severity="warning")
            return
        delete_conversation(self.directory, chosen.id)
        self.notify(f"Deleted {chosen.title}.")
        self.refresh_list()

    def action_cancel(self) -> None:
        title = self.query_one("#conversations-title", Input)
        if title.display:
            title.display = False
            self.query_one(OptionList).focus()
            return
        self.dismiss(None)
