"""The help screen (F1, /help): the keys, how to attach documents, what the panels show."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Markdown

from cpchat import __version__

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
their paths), type their paths before your question (cpchat offers to attach
them: Enter attaches, Esc sends the text as typed), type `/attach PATH`, or use
the picker. PDF, EPUB, HTML, DOCX,
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

**Commands.** `/attach PATH`, `/model [MODEL]` (switch every rank to another model, keeping the
conversation: without MODEL a picker lists the models on this machine, those cpchat cannot run
greyed with the reason; or a directory, a hub id, a GGUF file, `ollama:NAME[:TAG]` or `smollm2`),
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
