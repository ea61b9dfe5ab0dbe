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
            raise BadInput(
                f"{path} is too large ({size >> 20} MiB; the limit is {MAX_DOCUMENT_BYTES >> 20} MiB)"
            )
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


def render_document(name: str, text: str) -> str:
    """One attached document as it appears inside a user message (the demo model is trained on this)."""
    return f'<document name="{name}">\n{text.strip()}\n</document>'


def render_user_turn(documents: list[Document], text: str) -> str:
    """Documents first, then the user's words (as they are, when there is no document)."""
    if not documents:
        return text
    parts = [render_document(d.name, d.text) for d in documents]
    return "\n\n".join(parts + ([text.strip()] if text.strip() else []))
