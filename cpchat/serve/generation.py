"""Requests waiting for the ranks in order, up to a bound; and one request's generation, run by the
scheduler's thread (cpchat.serve.scheduler) and read from the event loop.

The session keeps what the ranks hold between requests: a request whose prompt starts with the
last conversation's tokens (a long system prompt or document sent every time) prefills only the
rest, and with the prefix cache, one that starts like a saved conversation loads it from disk.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cpchat.client.events import Done, Event, Prefill, Progress, Token
from cpchat.client.session import SamplingOptions, Session
from cpchat.errors import BackendError, BadInput
from cpchat.serve.openai_api import ApiError, GenerationParams, Outcome
from cpchat.serve.scheduler import Scheduler

RETRY_AFTER_S = 5  # what a refused client is told to wait


@dataclass
class QueueState:
    served: int = 0
    cancelled: int = 0  # stopped by a client that went away


class RankQueue:
    """Admission: requests wait for the ranks in order, up to `bound` of them; past that, 429 with
    Retry-After. The scheduler runs them (`max_batch` answers decoding together at most)."""

    def __init__(self, bound: int, scheduler: Scheduler) -> None:
        self.bound = bound
        self.state = QueueState()
        self.scheduler = scheduler

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return self.scheduler.running

    async def start(self, generation: Generation) -> None:
        """Hand the generation to the ranks; return once they run it (raising what refused it)."""
        if self.waiting >= self.bound:
            raise ApiError(429, f"the ranks are busy and {self.waiting} requests are waiting; try "
                                "again shortly", kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        generation.scheduler = self.scheduler
        self.scheduler.submit(generation)
        try:
            await generation.admitted.wait()
        except asyncio.CancelledError:
            self.scheduler.cancel(generation)
            raise
        if generation.refusal is not None:
            raise generation.refusal

    def finished(self, cancelled: bool) -> None:
        self.state.served += 1
        self.state.cancelled += cancelled

    def stop(self) -> None:
        self.scheduler.stop()


@dataclass
class Piece:
    """What the client is sent next: text, and the tokens whose text it completes."""

    text: str
    tokens: list[Token] = field(default_factory=list)


class StopText:
    """Stop strings in the streamed text: text is held back while it could be the start of one, and
    the answer ends before the first one found."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""  # everything generated
        self.sent = 0  # of it, characters sent
        self.tokens: list[tuple[Token, int]] = []  # not sent yet, with the offset where each ends
        self.stopped = False

    def add(self, token: Token) -> Piece:
        self.text += token.text
        self.tokens.append((token, len(self.text)))
        found = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            self.stopped = True
            return self._send(min(found))
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._send(len(self.text) - held)

    def flush(self) -> Piece:
        return self._send(len(self.text)) if not self.stopped else Piece("")

    def _send(self, upto: int) -> Piece:
        upto = max(upto, self.sent)
        done = [t for t, end in self.tokens if end <= upto]
        self.tokens = [x for x in self.tokens if x[1] > upto]
        piece = Piece(self.text[self.sent:upto], done)
        self.sent = upto
        return piece


_END = object()


class Generation:
    """A request's generation on the ranks, run by the scheduler's thread and read from the event loop:
    `pieces()` yields the text as it comes; `close()` stops it if it is still under way and waits
    until the ranks are done with it."""

    def __init__(self, tokens: list[int], params: GenerationParams) -> None:
        self.tokens, self.params = tokens, params
        self.outcome = Outcome(prompt_tokens=len(tokens))
        self.stop = StopText(params.stop)
        self.finished = False  # the ranks ended the answer (or a stop string did), not a client
        self.cancelled = threading.Event()
        self.refusal: BaseException | None = None  # what refused it before it ran
        self.scheduler: Scheduler | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.admitted, self._done = asyncio.Event(), asyncio.Event()
        self._admitted = False

    # ---- the scheduler's side (its thread)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def prepare(self, session: Session) -> None:
        p = self.params
        session.sampling = SamplingOptions(p.max_tokens, p.temperature, p.top_p, p.seed, p.ignore_eos,
                                           p.top_logprobs)

    def admit(self, error: BaseException | None = None) -> None:
        """The ranks run it, or `error` refused it before they did (later errors come as events)."""
        if not self._admitted:
            self._admitted, self.refusal = True, error
            self._loop.call_soon_threadsafe(self.admitted.set)

    def put(self, item: Event | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._events.put_nowait, item)

    def end(self) -> None:
        self.put(_END)
        self._loop.call_soon_threadsafe(self._done.set)

    # ---- the event loop's side

    async def pieces(self) -> AsyncIterator[Piece | Progress]:
        """Text pieces (and prefill progress, for a stream to keep the connection busy) until the end;
        raises ApiError for what the ranks refused or could not do."""
        generated = 0
        while (event := await self._events.get()) is not _END:
            if isinstance(event, BaseException):
                raise api_error_of(event)
            if isinstance(event, Progress):
                yield event
            elif isinstance(event, Prefill):
                self.outcome.cached_tokens, self.outcome.algorithm = event.reused_tokens, event.algorithm
                self.outcome.cache = event.cache
            elif isinstance(event, Token) and not self.stop.stopped:
                generated += 1
                piece = self.stop.add(event)
                if self.stop.stopped:
                    self.scheduler.cancel(self)
                if piece.text or piece.tokens:
                    yield piece
            elif isinstance(event, Done):
                self.outcome.ttft_ms = event.ttft_ms
                self.outcome.decode_tokens_per_s = event.decode_tokens_per_s
        if (rest := self.stop.flush()).text or rest.tokens:
            yield rest
        self.outcome.completion_tokens = generated
        length = generated >= self.params.max_tokens and not self.stop.stopped
        self.outcome.finish_reason = "length" if length else "stop"
        self.finished = True

    async def close(self) -> None:
        """Stop the ranks if the answer is still coming (the client went away), and wait for them."""
        if self.scheduler is None:
            return
        if not self._done.is_set():
            self.scheduler.cancel(self)
        await self._done.wait()


def api_error_of(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, BadInput):
        return ApiError(400, str(error))
    if isinstance(error, BackendError):
        return ApiError(503, str(error), kind="server_error", code="backend_failed")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error")
