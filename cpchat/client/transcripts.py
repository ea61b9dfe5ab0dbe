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
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


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

    def __init__(self, directory: Path, path: Path | None = None) -> None:
        self.directory = directory
        self.path = path or directory / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}.jsonl")
        self.model = ""  # set_model
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Path, dict | None]] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._model_written: tuple[Path, str] | None = None  # the file and model last recorded together

    @staticmethod
    def last(directory: Path) -> Path | None:
        """The most recently changed transcript (ties: the greatest name)."""
        times = transcript_times(directory)
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
                    append_lines(path, lines)
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
        """The conversation saved in `path`; OSError when it cannot be read (gone, unreadable), so that
        the user is told, rather than shown an empty conversation."""
        return scan_records(read_records(path.read_bytes())).entries


def transcript_times(directory: Path) -> dict[Path, float]:
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


def append_lines(path: Path, lines: list[str]) -> None:
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


def read_records(raw: bytes, quick: bool = False) -> Iterator[dict]:
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
class TranscriptScan:
    """What one transcript file says: its messages and what the meta and usage lines add."""

    entries: list[Entry] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each entry's content length, for estimates
    model: str = ""
    title: str = ""
    tokens: int | None = None  # the last recorded turn's prompt + answer
    after_usage: int = 0  # how many of `entries` came after those counts
    records: int = 0  # lines that parsed as records of any kind


def scan_records(records: Iterable[dict]) -> TranscriptScan:
    scan = TranscriptScan()
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


def one_line(text: str, width: int | None = None) -> str:
    """Whitespace collapsed to single spaces; cut to `width` characters with an ellipsis."""
    text = " ".join(text.split())
    if width is not None and len(text) > width:
        text = text[: width - 1].rstrip() + "…"
    return text
