"""Modal screens: help, a file picker, what is attached, and a prompt past the model's context."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Markdown

from cpchat import __version__
from cpchat.client.documents import Document
from cpchat.tui.format import human_bytes, human_count

HELP = f"""\
# cpchat {__version__}

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

**Attaching documents.** Drop files or folders onto the terminal (a paste of
their paths), type `/attach PATH`, or use the picker. PDF, EPUB, HTML, DOCX,
Markdown, code and text are read (PDF pages and EPUB chapters keep a marker,
`[page 12]`); a folder brings its files, minus what `.gitignore` ignores,
vendored and binary files. Each becomes a chip with its format, pages or files
and token count; click one (or *List attachments* in the palette) to see what
went in. Esc stops the reading of a large one. The text goes into your next
message with its file name. A prompt past the model's context asks first.

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


def describe_document(document: Document, tokens: int | None) -> str:
    """A document as Markdown: what it is, and for a folder each file and what was left out."""
    count = f"{tokens:,} tokens" if tokens is not None else "tokens not counted yet"
    if document.kind == "folder":
        size = human_bytes(document.size)
        lines = [f"### {document.name}/ · {document.files} files · {size} · {count}", ""]
        lines += [f"- `{s.name}`" for s in document.sections]
        if document.left_out:
            lines += ["", "**Left out:**", ""] + [f"- {why}" for why in document.left_out]
        return "\n".join(lines)
    pages = f" · {document.pages} {document.unit}" if document.pages else ""
    return f"### {document.name}\n\n{document.kind}{pages} · {human_bytes(document.size)} · {count}"


class AttachmentsScreen(ModalScreen[None]):
    """What goes into the next message: every attached document, and a folder's files."""

    BINDINGS = [Binding("escape,q", "dismiss", "Close")]

    def __init__(self, documents: list[tuple[Document, int | None]]) -> None:
        super().__init__()
        self.documents = documents

    def compose(self) -> ComposeResult:
        text = "\n\n".join(describe_document(d, t) for d, t in self.documents) or "Nothing is attached."
        with Vertical(id="attachments-dialog"):
            yield Markdown(text)

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class ContextBudget(ModalScreen[str | None]):
    """The prompt is longer than the model's context: remove an attachment and send, send anyway, or
    go back. Dismisses with "remove:<index>", "send" or None."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    def __init__(self, prompt_tokens: int, limit: int, attachments: list[tuple[str, int | None]]) -> None:
        super().__init__()
        self.prompt_tokens, self.limit, self.attachments = prompt_tokens, limit, attachments

    def compose(self) -> ComposeResult:
        with Vertical(id="budget-dialog"):
            yield Label(f"This prompt is {self.prompt_tokens:,} tokens; the model's context is "
                        f"{self.limit:,}.", id="budget-numbers")
            yield Label("Past its context the model has not learned to attend: answers get unreliable, "
                        "and memory and time grow with every token.", id="budget-why")
            with Vertical(id="budget-remove"):
                for i, (name, tokens) in enumerate(self.attachments):
                    size = f" ({human_count(tokens)} tok)" if tokens is not None else ""
                    yield Button(f"Remove {name}{size} and send", id=f"remove-{i}", compact=True)
            with Horizontal(id="budget-buttons"):
                yield Button("Send anyway", variant="warning", id="send", compact=True)
                yield Button("Back", id="back", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        name = event.button.id or ""
        self.dismiss(name.replace("remove-", "remove:") if name.startswith(("send", "remove-")) else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
