"""Modal screens: help, a file picker, what is attached, a prompt past the model's context, and
the model to switch to, and the saved conversations."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Markdown, OptionList
from textual.widgets.option_list import Option

from cpchat import __version__
from cpchat.client.conversations import (
    ConversationSummary,
    delete_conversation,
    list_conversations,
    rename_conversation,
)
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
| **Ctrl+B** | show or hide the side panels (collapsed to a status strip on narrow terminals) |
| **Ctrl+P** | command palette: attach, conversations, model, clear, algorithm, export, relaunch, help |
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

**Commands.** `/attach PATH`, `/model MODEL` (switch every rank to another model, keeping the
conversation: a directory, a hub id, a GGUF file, `ollama:NAME[:TAG]` or `smollm2`),
`/algorithm auto|pass_kv|pass_q|all_gather|ulysses`, `/clear`, `/export`, `/relaunch`, `/help`.

Transcripts are saved as they grow; `cpchat --list` lists them and `cpchat --resume [ID]` reopens
one (the last without an ID).
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


class ModelPrompt(ModalScreen[str | None]):
    """Asks for the model to switch to (a directory, hub id, GGUF file, ollama:NAME or smollm2);
    dismisses with it or None."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="model-dialog"):
            yield Label(f"Switch every rank from {self.current} to (the conversation stays):")
            yield Input(placeholder="a model directory, ORG/NAME[@rev], FILE.gguf, ollama:NAME or smollm2",
                        id="model-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


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
