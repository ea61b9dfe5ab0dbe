"""Answers decoded together: each has its own conversation on the ranks, read up to its first token by
a Generate (the session's), and one Step of the ranks (cpchat.rank.batch_step) gives every answer in
the batch its next token. An answer leaves at its stop token, its last token, or when cancelled; the
others go on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from cpchat.client.cluster import Cluster
from cpchat.client.events import Done, Event, Token
from cpchat.client.generation import GenerationRequest, StepRow
from cpchat.client.held import Held, HeldConversations
from cpchat.errors import BackendError


class Holds(Protocol):
    """What a batch reads of the session: the ranks and the conversations they hold."""

    cluster: Cluster
    conversations: HeldConversations

    def let_go(self, names: list[str]) -> None: ...


@dataclass(eq=False)
class Answer:
    """One request's answer after its first token: its conversation, what it has sampled, how it samples."""

    held: Held
    prompt: list[int]
    request: GenerationRequest  # the prefill's: sampling, stop tokens, shares
    max_tokens: int
    turn: int
    detokenizer: object
    generated: list[int]
    started: float  # time.perf_counter() when the request began
    first: float  # and when its first token came
    last: float = 0.0

    def row(self) -> StepRow:
        return StepRow(self.held.name, self.generated[-1], len(self.generated), self.request)

    def done(self) -> Done:
        tokens, last = len(self.generated), self.last or self.first
        rate = (tokens - 1) / (last - self.first) if tokens > 1 and last > self.first else 0.0
        return Done(self.turn, len(self.prompt), tokens, round(1000 * (self.first - self.started), 1),
                    round(rate, 2), [])


class Batch:
    """The answers under way, a token each a step."""

    def __init__(self, session: Holds) -> None:
        self.session = session
        self.answers: list[Answer] = []

    @property
    def tokens_to_come(self) -> int:
        """Tokens the answers under way may still add to the ranks' K/V (each up to its max_tokens)."""
        return sum(a.max_tokens - len(a.generated) for a in self.answers)

    def add(self, answer: Answer) -> None:
        self.session.conversations.busy.add(answer.held.name)
        self.answers.append(answer)

    def step(self) -> list[tuple[Answer, Token | Done]]:
        """One step for every answer: its next token, and Done for each that ends (BackendError: a rank
        failed, and every answer with it)."""
        answers = list(self.answers)
        try:
            sampled = self.session.cluster.step([a.row() for a in answers])
        except BaseException:
            self.fail()
            raise
        now, events = time.perf_counter(), []
        for answer, token in zip(answers, sampled, strict=True):
            if token.id in answer.request.stop_tokens:
                events.append((answer, self.end(answer, read=len(answer.generated))))
                continue
            answer.generated.append(token.id)
            answer.detokenizer.add_token(token.id)
            answer.last = now
            events.append((answer, Token(answer.turn, token.id, answer.detokenizer.last_segment,
                                         token.logprob, token.top)))
            if len(answer.generated) >= answer.max_tokens:
                events.append((answer, self.end(answer)))
        return events

    def cancel(self, answer: Answer) -> Done:
        """The answer leaves the batch before its end (its client went away)."""
        return self.end(answer)

    def end(self, answer: Answer, read: int | None = None) -> Done:
        """The answer leaves the batch; its conversation holds the prompt and the `read` tokens of the
        answer the ranks have read (all but the last one sampled, unless that was a stop token)."""
        read = len(answer.generated) - 1 if read is None else read
        answer.held.tokens = answer.prompt + answer.generated[:read]
        self.answers.remove(answer)
        conversations = self.session.conversations
        conversations.busy.discard(answer.held.name)
        self.session.let_go(conversations.over_budget())
        return answer.done()

    def fail(self) -> None:
        """A step failed: what the ranks hold of these conversations is unknown, so they are forgotten."""
        conversations, names = self.session.conversations, [a.held.name for a in self.answers]
        for name in names:
            conversations.busy.discard(name)
            conversations.let_go(name)
        self.answers.clear()
        with contextlib.suppress(BackendError):  # ranks that died let go of everything anyway
            self.session.let_go(names)


def until_batched(events: Generator[Event, None, Answer | None],
                  emit: Callable[[Event], None]) -> Answer | None:
    """Hand on a batched generation's events (up to its first token); the answer to decode on, if any."""
    while True:
        try:
            emit(next(events))
        except StopIteration as end:
            return end.value
