"""Saved conversations as lists show them: summaries read quickly from the transcript files, and
finding, renaming and deleting one by its id (cpchat.client.transcripts writes and reads the files)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cpchat.client.transcripts import (
    Entry,
    TranscriptStore,
    append_lines,
    one_line,
    read_records,
    scan_records,
    transcript_times,
)

TITLE_WIDTH = 60
RESUME_LAST = "last"  # what `--resume` with no ID stands for
CHARS_PER_TOKEN = 4  # the estimate for conversations saved without counts: English prose in BPE
TOKENS_PER_MESSAGE = 4  # chat-template markers around each message, for the same estimate


class UnknownConversation(ValueError):
    """No saved conversation has this id (or an id starting with it)."""

    def __init__(self, id: str, directory: Path) -> None:
        super().__init__(f"no saved conversation {id!r} in {directory} (`cpchat --list` shows them)")
        self.id = id


class AmbiguousConversation(ValueError):
    """More than one saved conversation has an id starting with what was typed."""

    def __init__(self, id: str, candidates: list[str]) -> None:
        more = f" and {len(candidates) - 5} more" if len(candidates) > 5 else ""
        shown = ", ".join(candidates[:5]) + more
        super().__init__(f"{id!r} could be any of {len(candidates)} conversations: {shown}; "
                         "type more of the id")
        self.id, self.candidates = id, candidates


@dataclass(frozen=True)
class ConversationSummary:
    """One saved conversation as a list shows it; `id` is the file's stem, typed to --resume."""

    id: str
    path: Path
    title: str
    updated: datetime
    model: str  # "" where the file predates recording it
    messages: int
    tokens: int
    tokens_estimated: bool  # True: from the text's length, not the ranks' count
    error: str = ""  # why the file could not be read; "" when it could


def estimate_tokens(sizes: list[int]) -> int:
    """A rough token count for messages of these lengths saved without the ranks' count."""
    return sum(-(-size // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE for size in sizes)


def _first_title(entries: list[Entry]) -> str:
    first = next((e for e in entries if e.role == "user"), None)
    if first is None:
        return "(empty)"
    if first.text.strip():
        return one_line(first.text, TITLE_WIDTH)
    if first.docs:
        return one_line(f"(documents only: {', '.join(first.docs)})", TITLE_WIDTH)
    return "(documents only)"


def summarize(path: Path) -> ConversationSummary:
    """The summary of one transcript file; a file that cannot be read comes back with `error` set.
    Raises OSError only when the file cannot even be stat'ed (e.g. deleted meanwhile)."""
    updated = datetime.fromtimestamp(path.stat().st_mtime).astimezone()

    def unreadable(why: str) -> ConversationSummary:
        title = f"(unreadable: {why})"
        return ConversationSummary(path.stem, path, title, updated, "", 0, 0, False, error=why)

    try:
        raw = path.read_bytes()
    except OSError as e:
        return unreadable(str(e.strerror or e))
    scan = scan_records(read_records(raw, quick=True))
    if not scan.records and raw.strip():
        return unreadable("no cpchat records")
    if scan.tokens is None:
        tokens, estimated = estimate_tokens(scan.sizes), bool(scan.entries)
    else:
        rest = scan.sizes[len(scan.sizes) - scan.after_usage:]
        tokens, estimated = scan.tokens + estimate_tokens(rest), bool(rest)
    return ConversationSummary(path.stem, path, scan.title or _first_title(scan.entries), updated, scan.model,
                               len(scan.entries), tokens, estimated)


def list_conversations(directory: Path) -> list[ConversationSummary]:
    """Every saved conversation, newest first (in the order `--resume` with no ID picks from)."""
    summaries: list[ConversationSummary] = []
    for path in transcript_times(directory):
        try:
            summaries.append(summarize(path))
        except OSError:
            continue  # removed while listing
    summaries.sort(key=lambda s: (s.updated, s.path.name), reverse=True)  # the order of `last`
    return summaries


def find_conversation(directory: Path, id: str) -> Path:
    """The transcript whose id is `id`, or the only one whose id starts with it."""
    id = id.strip()
    ids = sorted(p.stem for p in transcript_times(directory)) if id else []
    if id in ids:
        return directory / f"{id}.jsonl"
    matches = [i for i in ids if i.startswith(id)]
    if not matches:
        raise UnknownConversation(id, directory)
    if len(matches) > 1:
        raise AmbiguousConversation(id, matches)
    return directory / f"{matches[0]}.jsonl"


def resume_path(directory: Path, resume: str) -> Path | None:
    """The file `--resume [ID]` names: the newest for RESUME_LAST (None when there is none)."""
    if resume == RESUME_LAST:
        return TranscriptStore.last(directory)
    return find_conversation(directory, resume)


def rename_conversation(directory: Path, id: str, title: str) -> ConversationSummary:
    """Show `title` for the conversation in lists ("" restores the first message's text). The title is
    a meta line appended to the file, its messages untouched; the file's time is kept, so that renaming
    does not make an old conversation the one `--resume` reopens."""
    path = find_conversation(directory, id)
    before = path.stat()
    append_lines(path, [json.dumps({"meta": {"title": one_line(title)}}, ensure_ascii=False) + "\n"])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return summarize(path)


def delete_conversation(directory: Path, id: str) -> Path:
    """Remove the conversation's file; returns the path removed."""
    path = find_conversation(directory, id)
    path.unlink()
    return path


# ---- `cpchat --list`


def _model_label(model: str) -> str:
    """As the app's title bar names it: a directory by its last part, a hub id by its name."""
    return one_line(Path(model).name or model, 32) if model else "-"


def format_conversations(summaries: list[ConversationSummary]) -> str:
    """An aligned plain-text table, one conversation a line, in the order given; `~` marks estimates."""
    rows = [("ID", "UPDATED", "MODEL", "TOKENS", "MSGS", "TITLE")]
    for s in summaries:
        tokens = ("~" if s.tokens_estimated else "") + f"{s.tokens:,}"
        rows.append((s.id, s.updated.strftime("%Y-%m-%d %H:%M"), _model_label(s.model), tokens,
                     str(s.messages), s.title))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                 r[3].rjust(widths[3]), r[4].rjust(widths[4]), r[5]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def print_conversations(directory: Path) -> int:
    """`cpchat --list`: the table on stdout, or one line when there is nothing saved; exit status 0."""
    summaries = list_conversations(directory)
    table = format_conversations(summaries) if summaries else f"no saved conversations in {directory}"
    print(table, flush=True)  # a reader that has gone (`| head`) is seen here, not at exit
    return 0
