"""The question a message that starts with paths asks: attach them, or send the message as typed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from cpchat.client.documents import Document, DocumentCancelled
from cpchat.errors import BadInput
from cpchat.tui.format import human_count
from cpchat.tui.messages import DocumentRead

Reader = Callable[[Path, threading.Event], tuple[Document, int | None]]


class AttachTyped(ModalScreen[list[DocumentRead] | None]):
    """Reads and counts the paths (`read`, in a thread worker) while it asks; Enter attaches them
    and sends the rest of the message (once read), Esc sends the message as text. Dismisses with
    the documents read, or None."""

    BINDINGS = [Binding("enter", "attach", "Attach and send", priority=True),
                Binding("escape", "as_text", "Send as text")]

    question: reactive[str] = reactive("", layout=True)

    def __init__(self, paths: list[Path], read: Reader) -> None:
        super().__init__()
        self.paths, self._read = paths, read
        self.documents: list[DocumentRead] = []
        self.errors: list[str] = []
        self.done = False
        self.confirmed = False
        self._cancel = threading.Event()
        self.set_reactive(AttachTyped.question, self._ask())

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-dialog"):
            yield Label(self.question, id="attach-question")
            with Horizontal(id="attach-buttons"):
                yield Button("Attach and send", variant="primary", id="attach", compact=True)
                yield Button("Send as text", id="as-text", compact=True)

    def on_mount(self) -> None:
        self.read_all()

    def watch_question(self, question: str) -> None:
        if self.is_mounted:
            self.query_one("#attach-question", Label).update(question)

    @work(thread=True, exit_on_error=False)
    def read_all(self) -> None:
        for path in self.paths:
            try:
                document, tokens = self._read(path, self._cancel)
            except DocumentCancelled:
                return
            except BadInput as e:
                self.errors.append(str(e))
            else:
                self.documents.append(DocumentRead(path, document, tokens))
            self.app.call_from_thread(setattr, self, "question", self._ask())
        self.app.call_from_thread(self._read_all_done)

    def _read_all_done(self) -> None:
        self.done = True
        self.question = self._ask()
        if self.confirmed:
            self.action_attach()

    def _ask(self) -> str:
        read = {d.path: d for d in self.documents}
        names = []
        for path in self.paths:
            doc = read.get(path)
            size = (f" ({human_count(doc.tokens)} tok)" if doc and doc.tokens is not None else
                    "" if doc or self.done else " (reading…)")
            names.append(f"{path.name}{size}")
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
        problems = "".join(f"\n{e}" for e in self.errors)
        return f"Attach {listed} and send?{problems}\nEnter attaches · Esc sends as text"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_attach() if event.button.id == "attach" else self.action_as_text()

    def action_attach(self) -> None:
        """Attach what was read; while reading, once it is read."""
        if not self.done:
            self.confirmed = True
            return
        self.dismiss(self.documents)

    def action_as_text(self) -> None:
        self._cancel.set()
        self.dismiss(None)
