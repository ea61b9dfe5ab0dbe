"""A request's prompt read in chunks (--prefill-chunk), so that the answers under way step on between
one chunk and the next, and a short request that comes meanwhile is read before the long one's rest
(cpchat.serve.scheduler reads the prompt with the fewest tokens left first).

Each chunk is a prefill of the prompt so far, continuing the conversation the last one left (as a
later turn continues one: exact). Chunks end every `chunk` tokens from where the kept tokens end, a
whole number of mlx-lm's own prefill calls (2,048 tokens), and a prompt whose K/V would turn quantized
partway (--kv-bits, before --quantized-kv-start) is read whole, where mlx-lm's calls put that turn.
Between chunks the conversation is busy: no other request continues it or lets it go.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from cpchat.client.batch import Answer, until_batched
from cpchat.client.events import Done, Event, Prefill, Progress, Token
from cpchat.client.session import Session
from cpchat.core.quantized_kv import PREFILL_STEP


class Sink(Protocol):
    def put(self, item: Event | BaseException) -> None: ...


def chunk_ends(keep: int, total: int, chunk: int) -> list[int]:
    """Where each chunk of a prompt of `total` tokens, `keep` of them held, ends (the last at `total`)."""
    chunk = -(-chunk // PREFILL_STEP) * PREFILL_STEP if chunk else 0
    if not chunk or total - keep <= chunk:
        return [total]
    return [*range(keep + chunk, total, chunk), total]


class Reading:
    """One request's prompt on its way through the ranks, chunk by chunk, then its first token."""

    def __init__(self, session: Session, tokens: list[int], max_tokens: int, chunk: int, batched: bool,
                 sink: Sink) -> None:
        self.session, self.tokens, self.max_tokens, self.batched, self.sink = (
            session, tokens, max_tokens, batched, sink)
        _, keep = session.conversations.continued(tokens)
        kv = session.cluster.model.kv_format
        if kv.quantized and keep < kv.start < len(tokens):
            chunk = 0
        self.ends = chunk_ends(keep, len(tokens), chunk)
        self.read = keep  # of the prompt, the tokens the ranks hold
        self.first: Prefill | None = None  # the first chunk's: what was kept, and from where
        self.started = time.perf_counter()
        self.name = ""  # the conversation, between chunks
        self.chunk_started = self.started

    @property
    def unread(self) -> int:
        """Tokens of the prompt the ranks have not read yet."""
        return len(self.tokens) - self.read

    @property
    def tokens_to_come(self) -> int:
        """Tokens its prompt's chunks not read yet and its answer may add to the ranks' K/V."""
        return self.unread + self.max_tokens

    def next(self) -> tuple[bool, Answer | None]:
        """Read the next chunk: whether the prompt is read, and then the answer to decode on (if any)."""
        conversations = self.session.conversations
        conversations.busy.discard(self.name)
        last = len(self.ends) == 1
        end = self.ends.pop(0)
        self.chunk_started = time.perf_counter()
        events = self.session.generate(self.tokens[:end], self.max_tokens if last else 0,
                                       batched=self.batched and last, save=last)
        answer = until_batched(events, self._pass_on)
        self.read = end
        if not last:
            self.name = conversations.current.name
            conversations.busy.add(self.name)
        elif answer is not None:
            answer.started = self.started
        return last, answer

    def abandon(self) -> None:
        self.session.conversations.busy.discard(self.name)

    def _pass_on(self, event: Event) -> None:
        """A chunk's events as the whole prompt's: progress over all of it, one Prefill, the answer's."""
        first = self.first
        if isinstance(event, Progress):  # event.cached: where this chunk starts
            kept = first.reused_tokens if first else event.cached
            event = Progress(event.turn, len(self.tokens), kept, event.cached - kept + event.processed,
                             round(1000 * (time.perf_counter() - self.started), 1))
        elif isinstance(event, Prefill):
            self.first = first = first or event
            if self.ends:
                return
            event = dataclasses.replace(event, new_tokens=len(self.tokens) - first.reused_tokens,
                                        cached_tokens=first.reused_tokens, reused_tokens=first.reused_tokens,
                                        cache=first.cache, load_ms=first.load_ms)
        elif isinstance(event, Done):
            if self.ends:
                return
            if not self.batched:  # the time to the first token, from the prompt's first chunk on
                earlier = 1000 * (self.chunk_started - self.started)
                event = dataclasses.replace(event, ttft_ms=round(event.ttft_ms + earlier, 1))
        elif not isinstance(event, Token) and self.ends:
            return
        self.sink.put(event)
