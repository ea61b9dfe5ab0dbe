"""Messages that carry backend news from worker threads up to the chat screen.

Workers never touch widgets: they post these (post_message is thread-safe),
and the screen turns them into reactive updates on the event loop. Tests and
snapshots post the same messages to freeze a state without timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from cpchat.client.events import AlgorithmChoice, Done, Prefill, RankStats
from cpchat.client.memory import MemoryShortfall
from cpchat.client.ranks import ServedModel
from cpchat.client.session import Turn


@dataclass
class RankInfo:
    rank: int
    address: str
    blas: str = ""
    slow_blas: bool = False
    threads: int = 0
    speed: float = 0.0  # tokens a second its forward runs, as it measured when the model loaded
    stage: int = 0  # the pipeline stage it runs (--stages)
    layers: tuple[int, int] = (0, 0)  # the layers [first, end) it runs


class BackendReady(Message):
    """The ring is formed and the model loaded on every rank."""

    def __init__(self, model: ServedModel, ranks: list[RankInfo], description: str = "",
                 blas_warning: str | None = None, transport: str = "") -> None:
        super().__init__()
        self.model, self.ranks, self.description = model, ranks, description
        self.blas_warning = blas_warning  # the ranks multiply with the slow reference BLAS
        self.transport = transport  # how tensors travel between the ranks: "mlx", "shm", "grpc", "shm+grpc"


class BackendFailed(Message):
    """Startup or a turn failed on the backend; `startup` failures end the app."""

    def __init__(self, message: str, startup: bool = False, exit_code: int = 3) -> None:
        super().__init__()
        self.message, self.startup, self.exit_code = message, startup, exit_code


class WorkProgress(Message):
    """Long work under way: phase "download" (MiB), "connect", "load", "read" (a document's pages
    or a folder's files: `label` names it) or "prefill"; done of total."""

    def __init__(self, phase: str, done: int, total: int, label: str = "") -> None:
        super().__init__()
        self.phase, self.done, self.total, self.label = phase, done, total, label


class StatsArrived(Message):
    def __init__(self, stats: RankStats) -> None:
        super().__init__()
        self.stats = stats


class PrefillDone(Message):
    def __init__(self, prefill: Prefill, choice: AlgorithmChoice | None) -> None:
        super().__init__()
        self.prefill, self.choice = prefill, choice


class TokensArrived(Message):
    """Text of one or more tokens (batched by the worker)."""

    def __init__(self, text: str, count: int) -> None:
        super().__init__()
        self.text, self.count = text, count


class TurnFinished(Message):
    """A turn ended: `done` when it completed or was stopped, `error` when the backend failed."""

    def __init__(self, done: Done | None = None, error: str = "", cancelled: bool = False) -> None:
        super().__init__()
        self.done, self.error, self.cancelled = done, error, cancelled


class DocumentRead(Message):
    """A document was read for attaching; `tokens` is None until the tokenizer has counted it."""

    def __init__(self, path, document, tokens: int | None) -> None:
        super().__init__()
        self.path, self.document, self.tokens = path, document, tokens


class TurnPrepared(Message):
    """A prompt was read into tokens (`turn`, None when it could not be) and is ready to send or to
    be weighed against the model's context; `expected_s` is the prefill's estimate, `shortfall` why
    some rank could not hold it (None: every rank can)."""

    def __init__(self, typed: str, turn: Turn | None, expected_s: float | None = None,
                 shortfall: MemoryShortfall | None = None) -> None:
        super().__init__()
        self.typed, self.turn, self.expected_s, self.shortfall = typed, turn, expected_s, shortfall


class Notice(Message):
    """A notification raised in a worker thread."""

    def __init__(self, text: str, severity: str = "information", timeout: float = 6.0) -> None:
        super().__init__()
        self.text, self.severity, self.timeout = text, severity, timeout


class ConversationCleared(Message):
    """The ranks dropped their KV; the transcript can be emptied."""


class ModelSwitched(Message):
    """The ranks run `model` now (None: the switch failed and they kept the old one)."""

    def __init__(self, model: str | None) -> None:
        super().__init__()
        self.model = model
