"""One request at a time on the ranks, the others waiting in order up to a bound; and one request's
generation, run in a thread (the session blocks on the ranks) and read from the event loop.

The session keeps what the ranks hold between requests: a request whose prompt starts with the
last conversation's tokens (a long system prompt or document sent every time) prefills only the
rest, and with the prefix cache, one that starts like a saved conversation loads it from disk.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cpchat.client.events import Done, Prefill, Progress, Token
from cpchat.client.session import SamplingOptions, Session
from cpchat.errors import BackendError, BadInput
from cpchat.serve.openai_api import ApiError, GenerationParams, Outcome

RETRY_AFTER_S = 5  # what a refused client is told to wait


@dataclass
class QueueState:
    running: bool = False
    waiting: int = 0
    served: int = 0
    cancelled: int = 0  # stopped by a client that went away


class RankQueue:
    """Admission: the ranks answer one request at a time; up to `bound` more wait, in order; past that,
    429 with Retry-After. Made on the event loop that uses it."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.state = QueueState()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        if self._lock.locked() and self.state.waiting >= self.bound:
            raise ApiError(429, f"the ranks are busy and {self.state.waiting} requests are waiting; try "
                                "again shortly", kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.state.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.state.waiting -= 1
        self.state.running = True

    def release(self, cancelled: bool) -> None:
        self.state.running = False
        self.state.served += 1
        self.state.cancelled += cancelled
        self._lock.release()


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
    """A request's generation on the ranks: `pieces()` yields the text as it comes; `close()` stops it
    if it is still under way and waits until the ranks are free."""

    def __init__(self, session: Session, tokens: list[int], params: GenerationParams) -> None:
        self.session, self.tokens, self.params = session, tokens, params
        self.outcome = Outcome(prompt_tokens=len(tokens))
        self.stop = StopText(params.stop)
        self.finished = False  # the ranks ended the answer (or a stop string did), not a client
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._produce, name="generation", daemon=True)
        self._done = asyncio.Event()

    def start(self) -> None:
        p = self.params
        self.session.sampling = SamplingOptions(p.max_tokens, p.temperature, p.top_p, p.seed, p.ignore_eos,
                                                p.top_logprobs)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for event in self.session.generate(self.tokens, self.params.max_tokens):
                self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except BaseException as e:  # handed to the loop, raised there
            self._loop.call_soon_threadsafe(self._events.put_nowait, e)
        finally:
            self._loop.call_soon_threadsafe(self._events.put_nowait, _END)
            self._loop.call_soon_threadsafe(self._done.set)

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
                    await asyncio.to_thread(self.session.cancel)
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
        if self._thread.is_alive() and not self._done.is_set():
            await asyncio.to_thread(self.session.cancel)
        if self._thread.ident is not None:
            await self._done.wait()


def api_error_of(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, BadInput):
        return ApiError(400, str(error))
    if isinstance(error, BackendError):
        return ApiError(503, str(error), kind="server_error", code="backend_failed")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error")
