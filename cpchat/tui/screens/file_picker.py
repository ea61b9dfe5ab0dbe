"""The file picker (Ctrl+O, /attach without a path): a document to attach."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label


class FilePicker(ModalScreen[Path | None]):
    """Browse from a directory, or type a path; Enter on a file (or in the box) attaches it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, start: Path) -> None:
        super().__init__()
        self.start = start

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-dialog"):
            yield Label("Attach a document: pick a file, or type a path (a folder too) and press Enter")
            yield Input(placeholder="path/to/file.txt", id="picker-path")
            yield DirectoryTree(self.start, id="picker-tree")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(Path(event.path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_cancel(self) -> None:
        self.dismiss(None)
