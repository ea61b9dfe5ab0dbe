"""Attached documents: read them safely and render them into a user turn."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpchat.client.cluster import BadInput

MAX_DOCUMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    size: int


def read_document(path: Path) -> Document:
    """A UTF-8 text file, or BadInput saying why not."""
    path = path.expanduser()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise BadInput(f"{path} is not a file")
        if size > MAX_DOCUMENT_BYTES:
            raise BadInput(f"{path} is too large ({size >> 20} MiB; the limit is {MAX_DOCUMENT_BYTES >> 20} MiB)")
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"no such file: {path}") from None
    except PermissionError:
        raise BadInput(f"cannot read {path}: permission denied") from None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    if b"\0" in data[:8192]:
        raise BadInput(f"{path} looks binary, not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{path} is not UTF-8 text") from None
    return Document(path.name, text, size)


def render_document(doc: Document) -> str:
    return f'<document name="{doc.name}">\n{doc.text.rstrip()}\n</document>'


def render_user_turn(documents: list[Document], text: str) -> str:
    """Documents first, then the user's words."""
    return "\n\n".join([render_document(d) for d in documents] + ([text] if text else []))
