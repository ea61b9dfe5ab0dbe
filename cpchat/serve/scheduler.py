"""The ranks' one thread in `cpchat serve`: requests start in the order they came, up to --max-batch at
once. Their prompts are read a chunk at a time (--prefill-chunk), the one with the fewest tokens left
to read first (the earliest among equals), and the answers under way decode together, a step for all
of them after each chunk: a long prompt holds the others' streams for one chunk, a short request that
comes meanwhile waits for one chunk too, and prompts of one length are read one after another, each
answer starting as soon as its own prompt is read.
With a batch of one each answer runs whole, in turn (a rank's own decode loop).

Only this thread talks to the ranks for the requests; the event loop hands it requests and takes
their events (cpchat.serve.generation.Generation).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from cpchat.client.batch import Answer, Batch
from cpchat.client.events import Done, Event
from cpchat.client.session import Session
from cpchat.serve.openai_api import ApiError
from cpchat.serve.reading import Reading


class Request(Protocol):
    """A request as the scheduler runs it (cpchat.serve.generation.Generation)."""

    tokens: list[int]
    max_tokens: int
    cancelled: threading.Event

    def prepare(self, session: Session) -> None: ...  # its sampling, on the session

    def admit(self, error: BaseException | None = None) -> None: ...  # it runs (or is refused)

    def put(self, item: Event | BaseException) -> None: ...

    def end(self) -> None: ...


class Scheduler:
    """Runs requests on the session's ranks: `max_batch` at most at once (prompts being read and answers
    decoding), each prompt read `prefill_chunk` tokens at a time (0: whole)."""

    def __init__(self, session: Session, max_batch: int, ranks_answer: Callable[[], None],
                 prefill_chunk: int = 0, on_step: Callable[[int], None] = lambda answers: None) -> None:
        self.session, self.max_batch, self.ranks_answer = session, max_batch, ranks_answer
        self.prefill_chunk = prefill_chunk
        self.on_step = on_step  # told how many answers each batched step advances
        self.batch = Batch(session)
        self.waiting: deque[Request] = deque()
        self.readings: list[tuple[Request, Reading]] = []  # prompts partly read, in the order they started
        self._requests: dict[Answer, Request] = {}  # the batch's
        self._changed = threading.Condition()
        self._stopping = False
        self._full_at: int | None = None  # the next request did not fit beside so many: it waits for fewer
        self._thread = threading.Thread(target=self._run, name="ranks", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self.batch.answers) + len(self.readings)

    def submit(self, request: Request) -> None:
        with self._changed:
            self.waiting.append(request)
            self._changed.notify()

    def cancel(self, request: Request) -> None:
        """Stop a request: one waiting ends now, one being read stops at its next event, one in the batch
        leaves it before the next step."""
        request.cancelled.set()
        with self._changed:
            if request in self.waiting:
                self.waiting.remove(request)
                request.admit(ApiError(499, "the client went away"))
                request.end()
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not (self._stopping or self.waiting or self.readings or self.batch.answers):
                    self._changed.wait()
                if self._stopping:
                    return
                room = self.running < min(self.max_batch, self._full_at or self.max_batch)
                request = self.waiting.popleft() if self.waiting and room else None
            if request is not None:
                self._begin(request)
            if self.readings:
                self._read_chunk()
            self._leave_cancelled()
            if self.batch.answers:
                self._step()

    def _begin(self, request: Request) -> None:
        """Check that the ranks answer and have the memory for the request beside what the others may still
        add (or it waits for fewer of them), and read it next."""
        session = self.session
        try:
            if not self.running:  # started again, the ranks would drop the others' conversations
                self.ranks_answer()
            others = self.batch.tokens_to_come + sum(r.tokens_to_come for _, r in self.readings)
            refused = session.make_room(request.tokens, request.max_tokens + others)
            if refused is not None and self.running:  # room comes back as they end
                with self._changed:
                    self.waiting.appendleft(request)
                self._full_at = self.running
                return
            self._full_at = None
            if refused is not None:
                raise ApiError(400, str(refused), code="insufficient_memory")
            request.prepare(session)
            reading = Reading(session, request.tokens, request.max_tokens, self.prefill_chunk,
                              self.max_batch > 1, _Watched(request, session))
        except BaseException as e:  # noqa: BLE001 - the request's to raise
            request.admit(e)
            request.end()
            return
        request.admit()
        self.readings.append((request, reading))

    def _read_chunk(self) -> None:
        """A chunk of the prompt with the fewest tokens left to read (the mean time to a first token is
        the shortest so)."""
        request, reading = entry = min(self.readings, key=lambda entry: entry[1].unread)
        try:
            read, answer = reading.next()
        except BaseException as e:  # noqa: BLE001 - the request's to raise
            self.readings.remove(entry)
            reading.abandon()
            request.put(e)
            request.end()
            return
        if not read:
            return  # on at the next chunk, or dropped (`_leave_cancelled`)
        self.readings.remove(entry)
        if answer is None:
            reading.abandon()
            request.end()
        else:
            self.batch.add(answer)
            self._requests[answer] = request

    def _leave_cancelled(self) -> None:
        for entry in [e for e in self.readings if e[0].cancelled.is_set()]:
            self.readings.remove(entry)
            entry[1].abandon()
            entry[0].end()
        for answer in list(self.batch.answers):
            request = self._requests[answer]
            if request.cancelled.is_set():
                self._ended(answer, self.batch.cancel(answer))

    def _step(self) -> None:
        answers = list(self.batch.answers)
        self.on_step(len(answers))
        try:
            events = self.batch.step()
        except BaseException as e:  # noqa: BLE001 - a rank failed: every answer in the batch with it
            for answer in answers:
                request = self._requests.pop(answer)
                request.put(e)
                request.end()
            return
        for answer, event in events:
            if isinstance(event, Done):
                self._ended(answer, event)
            else:
                self._requests[answer].put(event)

    def _ended(self, answer: Answer, done: Done) -> None:
        request = self._requests.pop(answer)
        request.put(done)
        request.end()


class _Watched:
    """A request's events while its prompt is read: a request cancelled meanwhile stops the ranks."""

    def __init__(self, request: Request, session: Session) -> None:
        self.request, self.session = request, session

    def put(self, item: Event | BaseException) -> None:
        self.request.put(item)
        if self.request.cancelled.is_set():
            self.session.cancel()
