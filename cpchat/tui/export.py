"""A conversation as Markdown (/export): what a person reads, not what the model saw (documents are
named, not copied)."""

from __future__ import annotations

import time
from pathlib import Path

from cpchat.client.transcripts import Entry


def export_markdown(entries: list[Entry]) -> str:
    parts = ["# cpchat transcript\n"]
    for e in entries:
        head = "## You" if e.role == "user" else "## Assistant"
        docs = f"\n\n*attached: {', '.join(e.docs)}*" if e.docs else ""
        parts.append(f"{head}\n\n{e.text}{docs}\n")
    return "\n".join(parts)


def export_transcript(entries: list[Entry], folder: Path) -> Path:
    """A new file in `folder`, named for the time, holding the Markdown; OSError when it cannot."""
    path = folder / time.strftime("cpchat-%Y%m%d-%H%M%S.md")
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(export_markdown(entries), encoding="utf-8")
    return path
