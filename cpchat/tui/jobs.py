"""The chat screen's blocking work, which its thread workers run: each job calls the backend (the
Frontend, its Session and Cluster) and posts what came of it as messages (cpchat.tui.messages).

Nothing here touches a widget, so none of it needs the event loop, and the loop never waits on it;
the screen decides when a job runs and what its messages change on screen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from textual.message import Message

from cpchat import EXIT_BACKEND, EXIT_USAGE
from cpchat.client.cluster import Cluster
from cpchat.client.documents import Document
from cpchat.client.events import CacheLoaded, Done, Prefill, Progress, RankStats, Token
from cpchat.client.frontend import Frontend
from cpchat.client.session import Turn
from cpchat.client.transcripts import Entry, TranscriptStore
from cpchat.errors import BackendError, BadInput
from cpchat.format import human_duration
from cpchat.tui.messages import (
    BackendFailed,
    BackendReady,
    ConversationCleared,
    ModelSwitched,
    Notice,
    PrefillDone,
    RankInfo,
    StatsArrived,
    TokensArrived,
    TurnFinished,
    TurnPrepared,
    WorkProgress,
)


class AnswerText:
    """The answer's text on its way to the screen: one TokensArrived at a time waits in the screen's
    queue, and what arrives meanwhile goes with the next one. A fast answer (hundreds of tokens a
    second) then cannot bury a key press such as Esc under thousands of messages."""

    def __init__(self, post: Callable[[Message], object]) -> None:
        self.post = post
        self._lock = threading.Lock()
        self._text, self._count, self._waiting = "", 0, False

    def add(self, text: str) -> None:
        """A token arrived (worker thread)."""
        with self._lock:
            self._text += text
            self._count += 1
            if not self._waiting:
                self._send()

    def shown(self) -> None:
        """The screen showed the last message (event loop): send what arrived meanwhile."""
        with self._lock:
            self._waiting = False
            if self._count:
                self._send()

    def flush(self) -> None:
        """The turn ended (worker thread): the rest goes now, before the turn's last message."""
        with self._lock:
            if self._count:
                self._send()

    def _send(self) -> None:
        self.post(TokensArrived(self._text, self._count))
        self._text, self._count, self._waiting = "", 0, True


class BackendJobs:
    """`post` delivers a message to the screen (post_message is thread-safe). `cancelled` says the
    answer under way was stopped (Esc), for the turn's last message."""

    def __init__(self, backend: Frontend, post: Callable[[Message], object]) -> None:
        self.backend, self.post = backend, post
        self.cancelled = False
        self.answer_text = AnswerText(post)
        self._stats_stop = threading.Event()

    # ---- the ranks and the model

    def start(self) -> None:
        """Connect (or launch) and load; a failure here ends the app with a one-line message."""
        try:
            description = self.backend.start(self.report)
            self._post_notes()
            if not self.backend.closing.is_set():
                self.post(self.ready(description))
        except BadInput as e:
            self.post(BackendFailed(str(e), startup=True, exit_code=EXIT_USAGE))
        except BackendError as e:
            self.post(BackendFailed(str(e), startup=True, exit_code=EXIT_BACKEND))

    def relaunch(self) -> None:
        """Replace the ranks with fresh local ones; the conversation is re-prefilled next turn."""
        self.stop_stats()
        try:
            self.backend.relaunch(self.report)
            if not self.backend.closing.is_set():
                self.post(self.ready())
                self.post(Notice("Ranks relaunched; the next turn re-reads the conversation."))
        except (BackendError, BadInput) as e:
            self.post(WorkProgress("connect", 0, 0))
            self.post(BackendFailed(f"relaunch failed: {e}"))

    def switch_model(self, model: str) -> None:
        """Every rank loads `model` from its own disk; on failure they go back to the old one. The
        next turn re-reads the conversation with the new model."""
        try:
            self.backend.switch_model(model, self.report)
            self._post_notes()
        except BadInput as e:
            self.post(Notice(f"could not switch to {model}: {e}", "error"))
            self.post(self.ready())
            self.post(ModelSwitched(None))
            return
        except BackendError as e:
            self.post(BackendFailed(f"could not switch to {model}: {e}"))
            self.post(ModelSwitched(None))
            return
        self.post(self.ready())
        self.post(ModelSwitched(model))

    def report(self, phase: str, done: int, total: int) -> None:
        """Progress of the backend's work; a load marks the ranks loading first."""
        cluster = self.backend.cluster
        if phase == "load" and done == 0 and cluster is not None:
            for r in cluster.ranks:
                self.post(StatsArrived(RankStats(r.rank, r.address, "loading")))
        if phase == "download":  # bytes, shown in MiB
            done, total = done >> 20, total >> 20
        self.post(WorkProgress(phase, done, total))

    def ready(self, description: str = "") -> BackendReady:
        cluster = self.backend.cluster
        assert cluster is not None and cluster.model is not None
        ranks = [RankInfo(r.rank, r.address, r.blas_label, r.slow_blas, r.blas.threads, speed, r.stage,
                          r.layers) for r, speed in zip(cluster.ranks, cluster.speeds(), strict=True)]
        return BackendReady(cluster.model, ranks, description, cluster.slow_blas_warning(),
                            cluster.transport_label)

    def _post_notes(self) -> None:
        for note in self.backend.take_notes():
            self.post(Notice(note[0].upper() + note[1:], timeout=10))

    # ---- the ranks' stats

    def stats_stream(self) -> threading.Event:
        """End the stats stream followed now and make the stop of the next one. Called on the event loop,
        as `stop_stats` is: a stream whose worker starts after the screen closed is stopped too (made in
        the worker, its stop would come after the screen's and the stream would outlive the app)."""
        self.stop_stats()
        self._stats_stop = threading.Event()
        return self._stats_stop

    def follow_stats(self, cluster: Cluster, stop: threading.Event) -> None:
        """Forward the ranks' stats until `stop`; they arrive only when something changed."""
        try:
            for stats in cluster.stats(interval_s=0.25, stop=stop):
                if stop.is_set():
                    break
                self.post(StatsArrived(stats))
        except Exception as e:  # the stream of a dying cluster; the rows already show it
            if not stop.is_set():
                self.post(Notice(f"rank stats stopped: {e}", "warning"))

    def stop_stats(self) -> None:
        self._stats_stop.set()

    # ---- the conversation

    def prepare(self, typed: str, text: str, documents: list[Document]) -> None:
        """Tokenize the prompt (a long document takes seconds) and estimate its prefill."""
        session = self.backend.session
        assert session is not None
        try:
            turn = session.prepare(text, documents)
            shortfall = session.turn_shortfall(turn) if session.fits(turn) else None
            estimate = session.prefill_estimate_s(turn)
        except (BadInput, BackendError) as e:  # a rank that stopped answering is reported by the monitor too
            self.post(Notice(str(e), "error"))
            self.post(TurnPrepared(typed, None))
            return
        self.post(TurnPrepared(typed, turn, estimate, shortfall))

    def generate(self, turn: Turn, entry: Entry, past_context: bool, store: TranscriptStore) -> None:
        """Run a turn; every event becomes a message. Tokens are saved before they are shown."""
        session = self.backend.session
        assert session is not None
        store.add(entry)
        answer = self.answer_text
        streamed = False
        label = ""  # the prefill's, once a saved prefix was loaded
        try:
            for event in session.run(turn, past_context):
                if isinstance(event, Token):
                    streamed = True
                    store.delta(event.text)
                    answer.add(event.text)
                elif isinstance(event, CacheLoaded):
                    label = f"Loaded {event.tokens:,} cached tokens in {event.ms / 1000:.1f} s · prefill"
                    self.post(WorkProgress("prefill", 0, len(turn.tokens) - event.tokens, label))
                elif isinstance(event, Progress):
                    self.post(WorkProgress("prefill", event.processed, event.total - event.cached, label))
                elif isinstance(event, Prefill):
                    self.post(PrefillDone(event, session.last_choice))
                elif isinstance(event, Done):
                    store.usage(event.prompt_tokens, event.generated_tokens)
                    answer.flush()
                    self.post(TurnFinished(done=event, cancelled=self.cancelled))
        except (BackendError, BadInput) as e:
            answer.flush()
            self.post(TurnFinished(error=str(e), cancelled=self.cancelled))
        except Exception as e:  # an unexpected client error must not take the transcript down
            answer.flush()
            self.post(TurnFinished(error=f"{type(e).__name__}: {e}"))
        finally:
            if streamed:
                store.end()

    def cancel(self) -> None:
        """Stop the answer under way now (what arrived stays); returns at once."""
        session = self.backend.session
        assert session is not None
        self.cancelled = True
        threading.Thread(target=session.cancel, name="cancel", daemon=True).start()

    def reset(self, failed: bool) -> None:
        """Forget the conversation: the ranks drop their KV (not failed ones: the session forgets)."""
        session = self.backend.session
        if session is not None and not failed:
            try:
                session.reset()
            except BackendError as e:
                self.post(Notice(f"could not reset the ranks: {e}", "error"))
                return
        elif session is not None:
            session.messages.clear()
        self.post(ConversationCleared())

    def announce_history_cost(self, name: str, messages: int) -> None:
        """What re-reading an opened conversation will cost, said before the next turn pays it."""
        session = self.backend.session
        assert session is not None
        try:
            tokens, saved, seconds = session.history_cost()
        except BackendError as e:
            self.post(Notice(f"Opened {name}; the ranks did not answer: {e}", "error"))
            return
        cost = f", about {human_duration(seconds)}" if seconds is not None and seconds >= 2 else ""
        if saved:
            self.post(Notice(f"Opened {name} ({messages} messages, {tokens:,} tokens): the ranks saved "
                             f"{saved:,} of them on disk; the next turn loads those and reads the rest"
                             f"{cost}.", timeout=10))
        else:
            self.post(Notice(f"Opened {name} ({messages} messages, {tokens:,} tokens): the next "
                             f"turn re-reads it on the ranks{cost}.", timeout=10))
