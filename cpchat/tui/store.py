"""Transcripts saved as they grow, so that a crash loses nothing already shown.

One JSON object per line, appended and fsync'ed: {"role", "text", "content",
"docs"} for a whole message, {"role": "assistant", "delta": ...} for a piece
of an answer still streaming, {"end": true} when it is complete. Reading
tolerates a torn last line.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
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
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Path, dict | None]] = queue.Queue()
        self._writer: threading.Thread | None = None

    @staticmethod
    def last(directory: Path) -> Path | None:
        files = sorted(directory.glob("*.jsonl"), key=lambda p: (p.stat().st_mtime, p.name))
        return files[-1] if files else None

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
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    try:
                        os.write(fd, "".join(lines).encode("utf-8"))
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # a full or read-only disk must not take the chat down
            for _ in batch:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything queued is on disk."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.join()

    def add(self, entry: Entry) -> None:
        self._append({"role": entry.role, "text": entry.text, "content": entry.content, "docs": entry.docs})

    def delta(self, text: str) -> None:
        if text:
            self._append({"role": "assistant", "delta": text})

    def end(self) -> None:
        self._append({"end": True})

    def clear(self) -> None:
        """Start a new file: the old conversation stays on disk."""
        self.path = self.directory / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}-{time.monotonic_ns()}.jsonl")

    @staticmethod
    def load(path: Path) -> list[Entry]:
        entries: list[Entry] = []
        streaming: Entry | None = None
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            if not isinstance(record, dict):
                continue
            if "delta" in record:
                if streaming is None:
                    streaming = Entry("assistant", "")
                    entries.append(streaming)
                streaming.text += str(record["delta"])
                streaming.content = streaming.text
            elif record.get("end"):
                streaming = None
            elif "role" in record:
                streaming = None
                entries.append(Entry(str(record["role"]), str(record.get("text", "")),
                                     str(record.get("content", "")), list(record.get("docs") or [])))
        return [e for e in entries if e.text or e.content]
