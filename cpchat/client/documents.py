"""Attached documents: files of any format cpchat reads, or whole folders, rendered into a user turn."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from cpchat.client.folders import ListingCancelled, list_folder
from cpchat.client.formats import Progress, ReadCancelled, Steps, Unreadable, extract
from cpchat.errors import BadInput
from cpchat.prompt import user_message

MAX_FILE_BYTES = 256 << 20  # a file on disk (a PDF of scans can be large; its text is what counts)
MAX_FOLDER_TEXT = 8_000_000  # characters of a folder's text: millions of tokens, past any model's context


@dataclass(frozen=True)
class Section:
    """One named text as the model sees it: a file, or one file of a folder (by its relative path)."""

    name: str
    text: str


@dataclass(frozen=True)
class Document:
    name: str  # the file or folder name, as on its chip
    kind: str  # "PDF", "EPUB", "HTML", "DOCX", "Markdown", "text", a language, or "folder"
    size: int  # bytes read from disk
    sections: tuple[Section, ...]
    pages: int = 0  # PDF pages or EPUB chapters (`unit` says which); 0 where there are none
    unit: str = ""
    left_out: tuple[str, ...] = field(default=())  # a folder's files not attached, one reason a line

    @property
    def files(self) -> int:
        return len(self.sections) if self.kind == "folder" else 1


class DocumentCancelled(Exception):
    """The user stopped the reading of a large document or folder."""


def read_document(path: Path, progress: Progress | None = None,
                  cancel: threading.Event | None = None) -> Document:
    """A file in any format cpchat reads, or a folder of them; BadInput naming the file and the reason."""
    path = path.expanduser()
    try:
        if path.is_dir():
            return read_folder(path, progress, cancel)
        data = _read_bytes(path)
        extracted = extract(path.name, data, progress, cancel)
    except Unreadable as e:
        raise BadInput(f"{path} {e}") from None
    except (ReadCancelled, ListingCancelled):
        raise DocumentCancelled(f"reading {path} was cancelled") from None
    return Document(path.name, extracted.kind, len(data), (Section(path.name, extracted.text),),
                    extracted.pages, extracted.unit)


def _read_bytes(path: Path) -> bytes:
    try:
        if not path.exists():
            raise BadInput(f"no such file or folder: {path}")
        if not path.is_file():
            raise BadInput(f"{path} is not a file or folder")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadInput(f"{path} is too large ({size >> 20} MiB; the limit is {MAX_FILE_BYTES >> 20} MiB)")
        return path.read_bytes()
    except PermissionError:
        raise BadInput(f"cannot read {path}: permission denied") from None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None


def read_folder(root: Path, progress: Progress | None = None,
                cancel: threading.Event | None = None) -> Document:
    """The folder's documents as one set, each named by its path from the folder's parent;
    what was skipped (ignored, vendored, binary, unreadable, past the cap) is summarised."""
    listing = list_folder(root, cancel)
    step = Steps(progress, cancel)
    sections: list[Section] = []
    left_out = list(listing.left_out)
    unreadable: list[str] = []
    size = chars = 0
    for i, relative in enumerate(listing.files):
        step(i, len(listing.files))
        if chars > MAX_FOLDER_TEXT:
            rest = len(listing.files) - i
            left_out.append(f"{rest} file{'s' * (rest > 1)} past the cap of {MAX_FOLDER_TEXT:,} characters, "
                            f"from {relative.as_posix()} on")
            break
        path = root / relative
        try:
            data = _read_bytes(path)
            text = extract(path.name, data).text
        except (BadInput, Unreadable) as e:
            unreadable.append(f"{relative.as_posix()} ({str(e).removeprefix(str(path)).strip()})")
            continue
        if not text.strip():
            continue
        sections.append(Section(f"{root.name}/{relative.as_posix()}", text))
        size += len(data)
        chars += len(text)
    step(len(listing.files), len(listing.files))
    if unreadable:
        left_out.append(f"{len(unreadable)} unreadable: " + "; ".join(unreadable[:3])
                        + (" …" if len(unreadable) > 3 else ""))
    if not sections:
        why = f" ({'; '.join(left_out)})" if left_out else ""
        raise BadInput(f"{root} has no text files to attach{why}")
    return Document(root.name, "folder", size, tuple(sections), left_out=tuple(left_out))


def render_sections(document: Document) -> str:
    return user_message([(s.name, s.text) for s in document.sections], "")


def render_user_turn(documents: list[Document], text: str) -> str:
    """Documents first, then the user's words (cpchat.prompt)."""
    return user_message([(s.name, s.text) for d in documents for s in d.sections], text)
