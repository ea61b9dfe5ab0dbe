"""Transcripts saved as they grow, so that a crash loses nothing already shown.

One JSON object per line, appended and fsync'ed: {"role", "text", "content",
"docs"} for a whole message, {"role": "assistant", "delta": ...} for a piece
of an answer still streaming, {"end": true} when it is complete. Reading
tolerates a torn last line.

Two more kinds of line describe the conversation rather than add to it, and
are absent from files written before them (such files still load and list):
{"meta": {"model": ...}} and {"meta": {"title": ...}} (the last of each wins;
an empty title restores the one taken from the first message), and
{"usage": {"prompt_tokens", "generated_tokens"}} after a turn, as the ranks
counted it. Readers that know only messages skip them, since they carry no
"role", "delta" or "end".
"""

from __future__ import annotations

import json
import os
import queue
import re
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

TITLE_WIDTH = 60
RESUME_LAST = "last"  # what `--resume` with no ID stands for
CHARS_PER_TOKEN = 4  # the estimate for conversations saved without counts: English prose in BPE
TOKENS_PER_MESSAGE = 4  # chat-template markers around each message, for the same estimate


@dataclass
class Entry:
    """A message as the transcript shows it (`text`) and as the model saw it (`content`)."""

    role: str
    text: str
    content: str = ""
    docs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.content = self.content or self.text


class TranscriptStore:
    """Appends to one .jsonl file under <data dir>/transcripts; thread-safe."""

    def __init__(self, directory: Path, path: Path | None = None, model: str = "") -> None:
        self.directory = directory
        self.path = path or directory / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}.jsonl")
        self.model = model
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Path, dict | None]] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._model_written: tuple[Path, str] | None = None  # the file and model last recorded together

    @staticmethod
    def last(directory: Path) -> Path | None:
        """The most recently changed transcript (ties: the greatest name)."""
        times = _transcript_times(directory)
        return max(times, key=lambda p: (times[p], p.name)) if times else None

    def _append(self, record: dict) -> None:
        """Queue a record; the writer thread appends and fsyncs (coalescing bursts of tokens)."""
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="transcripts", daemon=True)
                self._writer.start()
            self._queue.put((self.path, record))

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            by_path: dict[Path, list[str]] = {}
            for path, record in batch:
                if record is not None:
                    by_path.setdefault(path, []).append(json.dumps(record, ensure_ascii=False) + "\n")
            for path, lines in by_path.items():
                try:
                    _append_lines(path, lines)
                except OSError:
                    pass  # a full or read-only disk must not take the chat down
            for _ in batch:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything queued is on disk."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def set_model(self, name: str) -> None:
        """The model this conversation runs on. It is written with the next message, so that a
        start with no message leaves no file, and again only when the model or the file changes."""
        with self._lock:
            self.model = name

    def add(self, entry: Entry) -> None:
        with self._lock:
            model = self.model if self._model_written != (self.path, self.model) else ""
            if model:
                self._model_written = (self.path, model)
        if model:
            self._append({"meta": {"model": model}})
        self._append({"role": entry.role, "text": entry.text, "content": entry.content, "docs": entry.docs})

    def delta(self, text: str) -> None:
        if text:
            self._append({"role": "assistant", "delta": text})

    def end(self) -> None:
        self._append({"end": True})

    def usage(self, prompt_tokens: int, generated_tokens: int) -> None:
        """A finished turn's counts (Done.prompt_tokens, Done.generated_tokens): the prompt holds the
        whole conversation before the answer, so the last turn's sum is the conversation's size."""
        counts = {"prompt_tokens": int(prompt_tokens), "generated_tokens": int(generated_tokens)}
        self._append({"usage": counts})

    def clear(self) -> None:
        """Start a new file: the old conversation stays on disk."""
        self.path = self.directory / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}-{time.monotonic_ns()}.jsonl")

    @staticmethod
    def load(path: Path) -> list[Entry]:
        try:
            raw = path.read_bytes()
        except OSError:
            return []
        return _scan(_records(raw)).entries


def _transcript_times(directory: Path) -> dict[Path, float]:
    """Each transcript file's mtime; folders, and files removed while looking, left out."""
    times: dict[Path, float] = {}
    try:
        paths = list(directory.glob("*.jsonl"))
    except OSError:
        return times
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            times[path] = st.st_mtime
    return times


def _append_lines(path: Path, lines: list[str]) -> None:
    """Append and fsync; a last line torn by a crash is ended first, so that it does not swallow
    the first line written after it (a resumed conversation would lose that message)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        text = "".join(lines)
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading a whole file

BIG_LINE = 1 << 16  # a message line longer than this (documents) is summarized from its ends
_HEAD = re.compile(rb'\{"role": ("(?:[^"\\]|\\.)*"), "text": ("(?:[^"\\]|\\.)*"), "content": "')
_DOCS = b', "docs": '
_DELTA = b'{"role": "assistant", "delta": "'


def _records(raw: bytes, quick: bool = False) -> Iterator[dict]:
    """The file's records, one a line; lines that do not parse (torn by a crash) are skipped.

    Only "\n" ends a line: json.dumps leaves U+2028, U+0085 and the like unescaped inside strings,
    and splitting on them would tear the message that holds them. With `quick` (for summaries), the
    text of answers and of messages past BIG_LINE is not decoded: a run of delta lines comes back as
    one delta of "" and a message without "content", both with the length left out as "_chars".
    """
    pos, size = 0, len(raw)
    streamed = -1  # quick: bytes of the deltas since the last other line; -1 when none
    while pos < size:
        end = raw.find(b"\n", pos)
        end = size if end < 0 else end
        if quick and raw.startswith(_DELTA, pos, end) and raw.endswith(b'"}', pos + len(_DELTA), end):
            streamed = max(streamed, 0) + end - pos - len(_DELTA) - 2
            pos = end + 1
            continue
        if streamed >= 0:
            yield {"delta": "", "_chars": streamed}
            streamed = -1
        record = _big_message(raw, pos, end) if quick and end - pos > BIG_LINE else None
        if record is None:
            try:
                record = json.loads(raw[pos:end].decode("utf-8", errors="replace"))
            except ValueError:
                record = None
        if isinstance(record, dict):
            yield record
        pos = end + 1
    if streamed >= 0:
        yield {"delta": "", "_chars": streamed}


def _big_message(raw: bytes, start: int, end: int) -> dict | None:
    """A message line as TranscriptStore.add writes it, without decoding its content; None where
    the line is laid out otherwise (it is then parsed whole)."""
    head = _HEAD.match(raw, start, min(end, start + BIG_LINE))
    docs_at = raw.rfind(_DOCS, max(start, end - BIG_LINE), end)
    if head is None or docs_at < head.end() or raw[docs_at - 1:docs_at] != b'"':
        return None
    try:
        tail = raw[docs_at + len(_DOCS):end].decode("utf-8").rstrip()
        if not tail.endswith("}"):
            return None
        docs = json.loads(tail[:-1])
        role, text = json.loads(head.group(1)), json.loads(head.group(2))
    except ValueError:
        return None
    if not isinstance(docs, list):
        return None
    # characters, not bytes; an escape (\n, \") is two bytes for one character
    content = raw[head.end():docs_at - 1]
    chars = (len(content) if content.isascii() else len(content.decode("utf-8", errors="replace")))
    chars -= content.count(b"\\")
    return {"role": role, "text": text, "docs": docs, "_chars": chars}


@dataclass
class _Scan:
    """What one transcript file says: its messages and what the meta and usage lines add."""

    entries: list[Entry] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each entry's content length, for estimates
    model: str = ""
    title: str = ""
    tokens: int | None = None  # the last recorded turn's prompt + answer
    after_usage: int = 0  # how many of `entries` came after those counts
    records: int = 0  # lines that parsed as records of any kind


def _scan(records: Iterable[dict]) -> _Scan:
    scan = _Scan()
    messages: list[list] = []  # [entry, content length], the length of a streamed one completed at its end
    pieces: list[str] | None = None  # the answer streaming into messages[-1]
    usage_at = 0  # len(messages) when the last counts were recorded

    def stop_streaming() -> None:
        nonlocal pieces
        if pieces is not None:
            message = messages[-1]
            message[0].text = message[0].content = "".join(pieces)
            message[1] += len(message[0].text)
            pieces = None

    for record in records:
        scan.records += 1
        if "delta" in record:
            if pieces is None:
                messages.append([Entry("assistant", ""), 0])
                pieces = []
            pieces.append(str(record["delta"]))
            messages[-1][1] += record.get("_chars", 0)
        elif record.get("end"):
            stop_streaming()
        elif "role" in record:
            stop_streaming()
            entry = Entry(str(record["role"]), str(record.get("text", "")), str(record.get("content", "")),
                          list(record.get("docs") or []))
            messages.append([entry, record.get("_chars", len(entry.content))])
        elif isinstance(meta := record.get("meta"), dict):
            if isinstance(meta.get("model"), str):
                scan.model = meta["model"]
            if isinstance(meta.get("title"), str):
                scan.title = one_line(meta["title"])
        elif isinstance(usage := record.get("usage"), dict):
            try:
                scan.tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("generated_tokens", 0))
            except (TypeError, ValueError):
                continue
            usage_at = len(messages)
    stop_streaming()
    for i, (entry, size) in enumerate(messages):
        if entry.text or size:
            scan.entries.append(entry)
            scan.sizes.append(size)
            if scan.tokens is not None and i >= usage_at:
                scan.after_usage += 1
    return scan


# ---- saved conversations


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


def one_line(text: str, width: int | None = None) -> str:
    """Whitespace collapsed to single spaces; cut to `width` characters with an ellipsis."""
    text = " ".join(text.split())
    if width is not None and len(text) > width:
        text = text[: width - 1].rstrip() + "…"
    return text


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
    scan = _scan(_records(raw, quick=True))
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
    for path in _transcript_times(directory):
        try:
            summaries.append(summarize(path))
        except OSError:
            continue  # removed while listing
    summaries.sort(key=lambda s: (s.updated, s.path.name), reverse=True)  # the order of `last`
    return summaries


def find_conversation(directory: Path, id: str) -> Path:
    """The transcript whose id is `id`, or the only one whose id starts with it."""
    id = id.strip()
    ids = sorted(p.stem for p in _transcript_times(directory)) if id else []
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
    _append_lines(path, [json.dumps({"meta": {"title": one_line(title)}}, ensure_ascii=False) + "\n"])
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
    try:
        print(format_conversations(summaries) if summaries else f"no saved conversations in {directory}",
              flush=True)
    except BrokenPipeError:  # `cpchat --list | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0
