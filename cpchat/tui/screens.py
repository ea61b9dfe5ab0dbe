"""Modal screens: help, and a file picker for attaching documents."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label, Markdown

HELP = """\
# cpchat

Chat about long documents; attention runs context-parallel over the ranks on the right.

| key | action |
|---|---|
| **Enter** | send the prompt |
| **Ctrl+J** / Shift+Enter | new line in the prompt |
| **Up** / **Down** | recall earlier prompts |
| **Esc** | stop the answer (keeps what arrived) |
| **Ctrl+O** | attach a file (picker) |
| **Ctrl+P** | command palette: attach, clear, algorithm, export, relaunch ranks, help |
| **Ctrl+Q** | quit |

**Attaching documents.** Drop files onto the terminal (a paste of their paths),
type `/attach PATH`, or use the picker. Each becomes a chip with its size and
token count; the text goes into your next message with its file name.

**Panels.** *Ranks*: state, KV held and memory per rank. *Ring*: the algorithm
(pass-KV moves keys and values round the ring, pass-Q moves queries) and why
`auto` chose it, with the last ring pass per step. *Throughput*: time to first
token, prefill and decode rates, and context used.

Transcripts are saved as they grow; `cpchat --resume` reopens the last one.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog"):
            yield Markdown(HELP)

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class FilePicker(ModalScreen[Path | None]):
    """Browse from a directory, or type a path; Enter on a file (or in the box) attaches it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, start: Path) -> None:
        super().__init__()
        self.start = start

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-dialog"):
            yield Label("Attach a document: pick a file, or type a path and press Enter")
            yield Input(placeholder="path/to/file.txt", id="picker-path")
            yield DirectoryTree(self.start, id="picker-tree")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(Path(event.path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_cancel(self) -> None:
        self.dismiss(None)
