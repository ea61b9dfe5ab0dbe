"""The documents that go into the next message, as chips above the prompt. The bar reads them in
its own thread workers (a large PDF takes seconds, and Esc stops it), counts their tokens, and
warns of one longer than the model's context."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import work
from textual.containers import Horizontal

from cpchat.client.documents import Document, DocumentCancelled, read_document, render_sections
from cpchat.errors import BadInput
from cpchat.tui.messages import DocumentRead, Notice, WorkProgress
from cpchat.tui.paths import split_paste
from cpchat.tui.screens import AttachmentsScreen, FilePicker
from cpchat.tui.widgets.attachment_chip import AttachmentChip


class AttachmentBar(Horizontal):
    """`tokenizer` returns the tokenizer to count with, read when counting (None until the ranks are
    ready; switching the model changes it); `context_limit` is the model's context (0: not known)."""

    def __init__(self, tokenizer: Callable[[], Any], **kwargs) -> None:
        super().__init__(**kwargs)
        self._tokenizer = tokenizer
        self.context_limit = 0
        self.reading: threading.Event | None = None  # set it to stop the document being read

    def chips(self) -> list[AttachmentChip]:
        return list(self.query(AttachmentChip))

    def has(self, path: Path) -> bool:
        return any(c.path == path for c in self.chips())

    async def add(self, chip: AttachmentChip) -> None:
        await self.mount(chip)
        self.set_class(True, "-has-chips")

    async def clear(self) -> None:
        await self.remove_children()
        self.set_class(False, "-has-chips")

    async def remove_chip(self, chip: AttachmentChip) -> None:
        await chip.remove()
        self.set_class(bool(self.chips()), "-has-chips")

    # ---- reading

    def attach(self, paths: str = "") -> None:
        """Attach the paths given (as a paste would write them), or ask for one."""
        if paths:
            items = split_paste(paths)
            if not items:
                self.notify("Usage: /attach PATH [PATH…]", severity="warning")
                return
            self.attach_paths([Path(i).expanduser() for i in items])
            return

        def picked(path: Path | None) -> None:
            if path is not None:
                self.attach_paths([path])

        self.app.push_screen(FilePicker(Path.cwd()), picked)

    @work(thread=True, group="attach", exit_on_error=False)
    def attach_paths(self, paths: list[Path]) -> None:
        """Read each document off the loop, with progress; a bad one becomes a notice, never a
        crash, and Esc stops the reading (of this path and the rest)."""
        cancel = self.reading = threading.Event()
        try:
            for path in paths:
                try:
                    document = read_document(path, self._read_progress(path.name), cancel)
                except BadInput as e:
                    self.post_message(Notice(str(e), "error"))
                    continue
                except DocumentCancelled:
                    self.post_message(Notice(f"Stopped reading {path.name}; nothing was attached from it."))
                    break
                self.post_message(WorkProgress("read", 0, 0))
                self.post_message(DocumentRead(path, document, self._count(document)))
        finally:
            self.reading = None
            self.post_message(WorkProgress("read", 0, 0))

    def stop_reading(self) -> bool:
        """Esc: stop the document being read, if one is (what was read of it is dropped)."""
        if self.reading is None:
            return False
        self.reading.set()
        return True

    def _read_progress(self, name: str) -> Callable[[int, int], None]:
        """Reports of pages or files read, at most ten a second."""
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or done == total:
                last[0] = now
                self.post_message(WorkProgress("read", done, total, f"Reading {name}"))

        return report

    def read(self, path: Path, cancel: threading.Event) -> tuple[Document, int | None]:
        """One document read and counted, for a dialog that asks before attaching it (blocks: call
        it from a thread worker). Raises BadInput or DocumentCancelled."""
        document = read_document(path, self._read_progress(path.name), cancel)
        self.post_message(WorkProgress("read", 0, 0))
        return document, self._count(document)

    def _count(self, document: Document) -> int | None:
        tokenizer = self._tokenizer()
        return len(tokenizer.encode(render_sections(document))) if tokenizer is not None else None

    def count_tokens(self) -> None:
        """Count the chips read before there was a tokenizer."""
        self._count_chips([c for c in self.chips() if c.tokens is None])

    @work(thread=True, group="attach", exit_on_error=False)
    def _count_chips(self, chips: list[AttachmentChip]) -> None:
        for chip in chips:
            tokens = self._count(chip.document)
            self.app.call_from_thread(setattr, chip, "tokens", tokens)

    async def on_document_read(self, message: DocumentRead) -> None:
        message.stop()
        await self.take(message)

    async def take(self, message: DocumentRead) -> None:
        """A chip for a document read (unless it is attached already)."""
        path = message.path.resolve()
        if self.has(path):
            self.notify(f"{message.document.name} is already attached.")
            return
        await self.add(AttachmentChip(path, message.document, message.tokens))
        limit = self.context_limit
        if message.tokens and limit and message.tokens > limit:
            self.notify(f"{message.document.name} has {message.tokens:,} tokens, more than the model's "
                        f"{limit:,}-token context.", severity="warning")

    # ---- what the chips ask

    def on_attachment_chip_show(self, message: AttachmentChip.Show) -> None:
        self.app.push_screen(AttachmentsScreen([(message.chip.document, message.chip.tokens)]))

    def show_all(self) -> None:
        self.app.push_screen(AttachmentsScreen([(c.document, c.tokens) for c in self.chips()]))

    async def on_attachment_chip_remove(self, message: AttachmentChip.Remove) -> None:
        await self.remove_chip(message.chip)  # the message goes on up: the screen focuses the prompt
