"""The chat screen: the conversation and the prompt, beside live Ranks, Ring and Throughput panels.

The screen keeps the layout, the backend's life cycle (start, relaunch, switch the model, follow the
stats) and the turn (prepare, send, stream, finish). What waits on the ranks runs in its thread
workers (the jobs of cpchat.tui.jobs), which post messages that become updates on the event loop, so
the loop never waits on the backend. The widgets keep the rest: the answer its stream and clock, the
panels their arithmetic, the attachment bar its reading; the commands' table is cpchat.tui.commands.
"""

from __future__ import annotations

import shlex
import threading
from dataclasses import replace
from pathlib import Path

from textual import getters, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive, var
from textual.screen import Screen
from textual.widgets import Footer, Header

from cpchat.client.cluster import Cluster
from cpchat.client.connect import ClusterOptions
from cpchat.client.documents import Document
from cpchat.client.frontend import Frontend
from cpchat.client.models import local_models, model_dirs
from cpchat.client.ranks import ServedModel
from cpchat.client.session import Turn
from cpchat.client.settings import Settings, bundled
from cpchat.client.transcripts import Entry
from cpchat.core.algorithms import ALGORITHMS
from cpchat.dirs import data_dir
from cpchat.tui import messages as m
from cpchat.tui.commands import run_slash
from cpchat.tui.conversation import Conversation, ConversationActions
from cpchat.tui.jobs import BackendJobs
from cpchat.tui.paths import leading_paths
from cpchat.tui.prefs import load_panels, save_panels
from cpchat.tui.screens import AttachTyped, ContextBudget, MemoryBudget, ModelPicker
from cpchat.tui.widgets import (
    Answer,
    AttachmentBar,
    AttachmentChip,
    ChatInput,
    SidePanels,
    StatusStrip,
    Transcript,
    WorkBar,
)

NARROW_BELOW = 110  # columns: the side panels take 48, the conversation keeps at least 62


class ChatScreen(ConversationActions, Screen):
    """`cluster`/`model_path` inject a running, loaded cluster (tests); otherwise the screen
    launches or attaches its own from `options`. `resume` is a saved conversation to go on with.
    `start_backend=False` leaves the backend out entirely, for snapshots that post messages themselves."""

    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("ctrl+o", "attach_file", "Attach"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+r", "relaunch", "Relaunch ranks"),
        Binding("ctrl+b", "toggle_panels", "Panels"),
    ]
    # Below this width the side panels collapse to the status strip (unless Ctrl+B shows them).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_BELOW, "-wide")]

    panels: var[str] = var("auto")  # "auto" | "shown" | "hidden" (cpchat.tui.prefs)
    busy: reactive[bool] = reactive(False)
    failed: reactive[bool] = reactive(False)

    transcript = getters.query_one(Transcript)
    work_bar = getters.query_one(WorkBar)
    attachments = getters.query_one(AttachmentBar)
    prompt = getters.query_one(ChatInput)
    side = getters.query_one(SidePanels)

    def __init__(
        self,
        settings: Settings,
        options: ClusterOptions | None = None,
        *,
        cluster: Cluster | None = None,
        model_path: str | None = None,
        resume: Path | None = None,
        start_backend: bool = True,
        transcripts: Path | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.backend = Frontend(settings, options or ClusterOptions(), cluster, model_path)
        self.jobs = BackendJobs(self.backend, self.post_message)
        self.resume, self.start_backend = resume, start_backend
        self.model: ServedModel | None = None
        self.conversation = Conversation(transcripts or data_dir() / "transcripts")
        self.turns_done = 0
        self.answer: Answer | None = None  # the one streaming
        self._failed_ranks: set[int] = set()
        self._preparing = False
        self._prefill_expected: float | None = None
        self._opened = ""  # a conversation opened before the ranks were ready: its cost is still to say
        self.prefs_path = self.conversation.store.directory.parent / "tui.json"
        self.set_reactive(ChatScreen.panels, load_panels(self.prefs_path))

    # ---- layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield Transcript(id="transcript")
                yield StatusStrip(id="strip")
                yield WorkBar(id="work")
                yield AttachmentBar(lambda: self.backend.tokenizer, id="attachments")
                yield ChatInput(id="prompt", placeholder="Ask about your documents…  (drop files to attach)")
            yield SidePanels(id="side")
        yield Footer()

    def watch_panels(self, panels: str) -> None:
        self.set_class(panels == "shown", "-panels-shown")
        self.set_class(panels == "hidden", "-panels-hidden")

    def action_toggle_panels(self) -> None:
        """Show the panels if they are collapsed here, collapse them if shown; remembered."""
        self.panels = "hidden" if self.side.display else "shown"
        try:
            save_panels(self.prefs_path, self.panels)
        except OSError as e:
            self.notify(f"could not remember the panels' choice: {e.strerror}", severity="warning")

    def on_mount(self) -> None:
        self.watch_panels(self.panels)
        self.side.ring.mode = self.settings.algorithm
        self.work_bar.hide()
        self.prompt.focus()
        if self.resume is not None:
            self.open_conversation(self.resume)
        if self.start_backend:
            self.app.sub_title = "starting…"
            self.start_cluster()

    def on_unmount(self) -> None:
        """Stop everything that waits on the ranks; close the ranks we launched."""
        self.jobs.stop_stats()
        self.conversation.store.flush()
        self.backend.close(generating=self.busy)

    # ---- backend life cycle

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def start_cluster(self) -> None:
        self.jobs.start()

    async def on_backend_ready(self, message: m.BackendReady) -> None:
        self.model = message.model
        self.conversation.store.set_model(message.model.name)
        self.failed = False
        self._failed_ranks.clear()
        self.work_bar.hide()
        await self.side.show_ready(message)
        self.attachments.context_limit = message.model.max_context
        name = Path(message.model.name).name or message.model.name
        self.app.sub_title = f"{name} · {len(message.ranks)} ranks"
        welcome = self.transcript.welcome
        welcome.model, welcome.ranks = name, len(message.ranks)
        demo = Path(message.model.name) == bundled("demo-model")  # the trained one: it can answer the sample
        welcome.sample = self.sample_path() if demo else ""
        if message.description and not self.settings.model:
            self.notify(f"Using {message.description}.", timeout=5)
        if message.blas_warning:
            self.notify(message.blas_warning[0].upper() + message.blas_warning[1:], title="Slow BLAS",
                        severity="warning", timeout=30)
        backend = self.backend
        if backend.cluster is not None and backend.tokenizer is not None:
            backend.session_for(self.conversation.as_sent())
            if self._opened:
                self.announce_history_cost(self._opened, len(self.conversation.entries))
                self._opened = ""
            self.follow_stats(backend.cluster, self.jobs.stats_stream())
            self.attachments.count_tokens()

    def on_backend_failed(self, message: m.BackendFailed) -> None:
        if message.startup:
            self.app.exit_message = message.message
            self.app.exit(return_code=message.exit_code)
            return
        self.notify(message.message, severity="error", timeout=10)

    @work(thread=True, group="stats", exclusive=True, exit_on_error=False)
    def follow_stats(self, cluster: Cluster, stop: threading.Event) -> None:
        self.jobs.follow_stats(cluster, stop)

    def on_stats_arrived(self, message: m.StatsArrived) -> None:
        if not self.is_mounted:
            return  # the stats thread outlived the screen (quitting)
        stats = message.stats
        self.side.show_stats(stats)
        if stats.state == "failed" and stats.rank not in self._failed_ranks:
            self._failed_ranks.add(stats.rank)
            self._report_failure(stats.error or f"rank {stats.rank} ({stats.address}) failed")

    def _report_failure(self, text: str) -> None:
        self.failed = True
        cluster = self.backend.cluster
        hint = " Press Ctrl+R to relaunch the ranks." if cluster is None or cluster.is_local else ""
        self.notify(f"{text}.{hint}", title="Rank failed", severity="error", timeout=30)

    def action_relaunch(self) -> None:
        """Replace the ranks with fresh local ones; the conversation is re-prefilled next turn."""
        if not self._idle():
            return
        if self.backend.cluster is not None and not self.backend.cluster.is_local:
            self.notify("These ranks were attached, not launched: restart them on their machines.",
                        severity="warning")
            return
        self.side.ranks.mark("starting")
        self.relaunch()

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def relaunch(self) -> None:
        self.jobs.relaunch()

    def action_switch_model(self, model: str | None = None) -> None:
        """Load another model on every rank (asking which when not given); the transcript stays."""
        cluster = self.backend.cluster
        if self.busy or cluster is None or cluster.model is None:
            self.notify("Wait for the ranks to be ready and the answer to end.", severity="warning")
            return
        if model is None:
            folders = model_dirs(self.settings.model_dirs)
            self.app.push_screen(ModelPicker(cluster.model.name, lambda: local_models(folders)),
                                 lambda m: m is not None and self.action_switch_model(m))
            return
        self.busy = True
        self.switch_model(model)

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def switch_model(self, model: str) -> None:
        self.jobs.switch_model(model)

    def on_model_switched(self, message: m.ModelSwitched) -> None:
        self.busy = False
        if message.model is not None:
            self.notify(f"Switched to {message.model}; the next turn re-reads the conversation.")

    def on_work_progress(self, message: m.WorkProgress) -> None:
        expected = self._prefill_expected if message.phase == "prefill" else None
        self.work_bar.progress(message.phase, message.done, message.total, message.label, expected)

    def on_notice(self, message: m.Notice) -> None:
        self.notify(message.text, severity=message.severity, timeout=message.timeout)  # type: ignore[arg-type]

    # ---- a turn

    @on(ChatInput.Submitted)
    async def on_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        if text.startswith("/") and run_slash(self, text):
            self.prompt.remember(text)
            self.prompt.clear()
            return
        chips = self.attachments.chips()
        if not text and not chips:
            return
        if self.busy:
            self.notify("An answer is still streaming; Esc stops it.", severity="warning")
            return
        if self.backend.session is None:
            self.notify("The ranks are not ready yet.", severity="warning")
            return
        if self.failed:
            self.notify("A rank has failed: press Ctrl+R to relaunch the ranks.", severity="error")
            return
        if self._preparing:
            return
        if event.attach_paths and (found := leading_paths(text)) is not None:
            self.ask_to_attach(event.text, *found)
            return
        self._preparing = True
        self.prepare_turn(event.text, text, [c.document for c in chips])

    def ask_to_attach(self, typed: str, paths: list[Path], rest: str) -> None:
        """A message that starts with paths: attach them and send the rest, or send it as typed."""

        async def decided(read: list[m.DocumentRead] | None) -> None:
            for document in read or []:
                await self.attachments.take(document)
            self.post_message(ChatInput.Submitted(rest if read else typed, attach_paths=False))

        self.app.push_screen(AttachTyped(paths, self.attachments.read), decided)

    @staticmethod
    def sample_path() -> str:
        """The sample document as the user would type it: relative here, ~/ at home, quoted if need be."""
        path = bundled("sample-doc.txt")
        for base, prefix in ((Path.cwd(), "./"), (Path.home(), "~/")):
            if path.is_relative_to(base):
                return prefix + shlex.quote(str(path.relative_to(base)))
        return shlex.quote(str(path))

    @work(thread=True, group="prepare", exit_on_error=False)
    def prepare_turn(self, typed: str, text: str, documents: list[Document]) -> None:
        self.jobs.prepare(typed, text, documents)

    async def on_turn_prepared(self, message: m.TurnPrepared) -> None:
        """Send the prompt; past the model's context ask first, past some rank's memory say why not."""
        self._preparing = False
        turn, session = message.turn, self.backend.session
        if turn is None or session is None:
            return
        if session.fits(turn) and message.shortfall is None:
            await self._send(message, past_context=False)
            return
        chips = self.attachments.chips()

        async def decided(choice: str | None) -> None:
            if choice == "send":
                await self._send(message, past_context=True)
            elif choice and choice.startswith("remove:"):
                await self.attachments.remove_chip(chips[int(choice.partition(":")[2])])
                self.post_message(ChatInput.Submitted(message.typed, attach_paths=False))

        attachments = [(c.document.name, c.tokens) for c in chips]
        if message.shortfall is not None:
            self.app.push_screen(MemoryBudget(message.shortfall, attachments), decided)
        else:
            self.app.push_screen(ContextBudget(len(turn.tokens), session.context_limit, attachments), decided)

    async def _send(self, message: m.TurnPrepared, past_context: bool) -> None:
        turn = message.turn
        assert turn is not None
        entry = Entry("user", message.typed.strip(), turn.content, turn.docs)
        self.prompt.remember(message.typed)
        self.prompt.clear()
        await self.attachments.clear()
        await self.show_turn(entry)
        self._prefill_expected = message.expected_s
        if self.backend.session is not None:
            self.post_message(m.WorkProgress("prefill", 0, self.backend.session.new_tokens(turn)))
        self.generate(turn, entry, past_context)

    async def show_turn(self, entry: Entry) -> None:
        """Show the user's message and an empty answer that tokens will stream into."""
        self.conversation.add(entry)
        self.answer = await self.transcript.show_turn(entry)
        self.jobs.cancelled = False
        self.busy = True
        self.transcript.scroll_end(animate=False)

    @work(thread=True, group="generate", exclusive=True, exit_on_error=False)
    def generate(self, turn: Turn, entry: Entry, past_context: bool) -> None:
        self.jobs.generate(turn, entry, past_context, self.conversation.store)

    def on_prefill_done(self, message: m.PrefillDone) -> None:
        self.work_bar.hide()
        self.side.show_prefill(message)

    async def on_tokens_arrived(self, message: m.TokensArrived) -> None:
        if self.answer is not None:
            await self.answer.write(message.text, message.count)
            self.side.throughput.pace = self.answer.pace
        self.jobs.answer_text.shown()

    async def on_turn_finished(self, message: m.TurnFinished) -> None:
        self.work_bar.hide()
        answer = self.answer
        text = answer.text if answer is not None else ""
        if answer is not None:
            await answer.finish(message.cancelled, failed=bool(message.error))
        # A failed turn without an answer keeps its user message on screen (the client dropped it
        # from the model's history).
        if text or message.done is not None:
            self.conversation.add(Entry("assistant", text))
        if message.done is not None:
            self.side.throughput.done = message.done
            self.turns_done += 1
        if message.error:
            cluster = self.backend.cluster
            failed = [r.rank for r in cluster.ranks if r.state == "failed"] if cluster is not None else []
            if failed:
                self.side.ranks.mark("failed", message.error, failed)
                self._failed_ranks.update(failed)
                self._report_failure(message.error)
            elif not self.failed:  # a failed rank was already reported by its stats stream
                self.notify(message.error, severity="error", timeout=10)
        self.busy = False
        self.answer = None

    def action_stop(self) -> None:
        """Esc: stop the reading of a document, or the answer now (what arrived stays)."""
        if not self.attachments.stop_reading() and self.busy and self.backend.session is not None:
            self.jobs.cancel()

    def _idle(self) -> bool:
        """No answer is streaming; when one is, say that it must be stopped first."""
        if self.busy:
            self.notify("Stop the answer first (Esc).", severity="warning")
        return not self.busy

    def watch_busy(self, busy: bool) -> None:
        self.prompt.set_class(busy, "-busy")
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":  # queried, not assumed: bindings may be checked before compose or after unmount
            reading = any(bar.reading is not None for bar in self.query(AttachmentBar))
            return True if self.busy or reading else None
        if action == "relaunch":
            return self.failed
        return True

    # ---- what the commands and the prompt's attachments ask (cpchat.tui.commands)

    @on(ChatInput.PathsDropped)
    def on_paths_dropped(self, event: ChatInput.PathsDropped) -> None:
        self.attachments.attach_paths(event.paths)

    async def on_document_read(self, message: m.DocumentRead) -> None:
        """A document read elsewhere: snapshots post them here (the bar's own reads stop at the bar)."""
        await self.attachments.take(message)

    def on_attachment_chip_remove(self, message: AttachmentChip.Remove) -> None:
        self.prompt.focus()  # the bar removed the chip; its button had the focus

    def action_attach_file(self, paths: str = "") -> None:
        self.attachments.attach(paths)

    def action_list_attachments(self) -> None:
        self.attachments.show_all()

    def action_set_algorithm(self, algorithm: str = "") -> None:
        if algorithm not in ALGORITHMS:
            self.notify(f"Usage: /algorithm {'|'.join(ALGORITHMS)}", severity="warning")
            return
        self.settings = replace(self.settings, algorithm=algorithm)
        if self.backend.session is not None:
            self.backend.session.planner.algorithm = algorithm
        self.side.ring.mode = algorithm
        self.notify(f"Ring algorithm: {algorithm}")
