"""What is attached (a chip clicked, /attachments): each document, and a folder's files."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Markdown

from cpchat.client.documents import Document
from cpchat.format import human_bytes


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
