"""The chat screen: transcript and prompt, with live Ranks, Ring and Throughput panels.

Everything that talks to the ranks (connect, load, generate, stats, reset,
cancel) runs in thread workers of this screen; they post messages
(cpchat.tui.messages) that become reactive updates on the event loop, which
therefore never waits on the backend.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive, var
from textual.screen import Screen
from textual.widgets import Footer, Header, Markdown

from cpchat import EXIT_BACKEND, EXIT_USAGE
from cpchat.client.cluster import Cluster, ServedModel
from cpchat.client.connect import ClusterOptions
from cpchat.client.documents import Document, DocumentCancelled, read_document, render_sections
from cpchat.client.events import Done, Prefill, Progress, RankStats, Token
from cpchat.client.session import Message as SessionMessage
from cpchat.client.session import Turn
from cpchat.client.settings import Settings
from cpchat.client.transcripts import Entry, TranscriptStore
from cpchat.core.algorithms import ALGORITHMS
from cpchat.core.estimate import human_duration
from cpchat.dirs import data_dir
from cpchat.errors import BackendError, BadInput
from cpchat.tui.backend import Backend
from cpchat.tui.commands import COMMANDS, Command, parse_slash
from cpchat.tui.messages import (
    BackendFailed,
    BackendReady,
    ConversationCleared,
    DocumentRead,
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
from cpchat.tui.paths import split_paste
from cpchat.tui.prefs import load_panels, save_panels
from cpchat.tui.screens import AttachmentsScreen, ContextBudget, ConversationsScreen, FilePicker, ModelPrompt
from cpchat.tui.widgets import (
    AttachmentBar,
    AttachmentChip,
    ChatInput,
    ChatMessage,
    RanksPanel,
    RingPanel,
    StatusStrip,
    ThroughputPanel,
    Transcript,
    WorkBar,
)

NARROW_BELOW = 110  # columns: the side panels take 48, the conversation keeps at least 62
WORK_LABELS = {"download": "Downloading model, MiB", "convert": "Converting GGUF, tensors",
               "connect": "Starting ranks", "load": "Loading model on ranks", "prefill": "Prefill, tokens"}


def shown(entry: Entry) -> ChatMessage:
    """A saved or sent message as the transcript shows it."""
    return ChatMessage(entry.role, entry.text or "*(documents only)*", entry.docs)


def as_sent(entries: list[Entry]) -> list[SessionMessage]:
    """The messages as the model saw them, for a session that goes on with them."""
    return [SessionMessage(e.role, e.content, e.docs) for e in entries]


class ChatScreen(Screen):
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
        self.backend = Backend(settings, options or ClusterOptions(), cluster, model_path)
        self.resume, self.start_backend = resume, start_backend
        self.model: ServedModel | None = None
        self.entries: list[Entry] = []
        self.store = TranscriptStore(transcripts or data_dir() / "transcripts")
        self.turns_done = 0
        self._stats_stop = threading.Event()
        self._answer: ChatMessage | None = None
        self._stream = None
        self._answer_text = ""
        self._tokens = 0
        self._first_token_at = self._sent_at = 0.0
        self._cancelled = False
        self._failed_ranks: set[int] = set()
        self._reading: threading.Event | None = None  # set it to stop the document being read
        self._preparing = False
        self._prefill_expected: float | None = None
        self._ring_steps: dict[int, RankStats] = {}
        self._opened = ""  # a conversation opened before the ranks were ready: its cost is still to say
        self.prefs_path = self.store.directory.parent / "tui.json"
        self.set_reactive(ChatScreen.panels, load_panels(self.prefs_path))

    # ---- layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield Transcript(id="transcript")
                yield StatusStrip(id="strip")
                yield WorkBar(id="work")
                yield AttachmentBar(id="attachments")
                yield ChatInput(id="prompt", placeholder="Ask about your documents…  (drop files to attach)")
            with VerticalScroll(id="side"):
                yield RanksPanel(id="ranks")
                yield RingPanel(id="ring")
                yield ThroughputPanel(id="throughput")
        yield Footer()

    def watch_panels(self, panels: str) -> None:
        self.set_class(panels == "shown", "-panels-shown")
        self.set_class(panels == "hidden", "-panels-hidden")

    def action_toggle_panels(self) -> None:
        """Show the panels if they are collapsed here, collapse them if shown; remembered."""
        self.panels = "hidden" if self.query_one("#side").display else "shown"
        try:
            save_panels(self.prefs_path, self.panels)
        except OSError as e:
            self.notify(f"could not remember the panels' choice: {e.strerror}", severity="warning")

    def on_mount(self) -> None:
        self.watch_panels(self.panels)
        self.query_one(RingPanel).mode = self.settings.algorithm
        self.query_one(WorkBar).hide()
        self.query_one(ChatInput).focus()
        if self.resume is not None:
            self.open_conversation(self.resume)
        if self.start_backend:
            self.app.sub_title = "starting…"
            self.start_cluster()

    # ---- backend life cycle

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def start_cluster(self) -> None:
        """Connect (or launch) and load; a failure here ends the app with a one-line message."""
        try:
            description = self.backend.start(self._report)
            self._post_notes()
            if not self.backend.closing.is_set():
                self.post_message(self._ready_message(description))
        except BadInput as e:
            self.post_message(BackendFailed(str(e), startup=True, exit_code=EXIT_USAGE))
        except BackendError as e:
            self.post_message(BackendFailed(str(e), startup=True, exit_code=EXIT_BACKEND))

    def _report(self, phase: str, done: int, total: int) -> None:
        """Progress of the backend's work, from its thread; a load marks the ranks loading first."""
        cluster = self.backend.cluster
        if phase == "load" and done == 0 and cluster is not None:
            for r in cluster.ranks:
                self.post_message(StatsArrived(RankStats(r.rank, r.address, "loading")))
        self.post_message(WorkProgress(phase, done, total))

    def _post_notes(self) -> None:
        for note in self.backend.take_notes():
            self.post_message(Notice(note[0].upper() + note[1:], timeout=10))

    def _ready_message(self, description: str = "") -> BackendReady:
        cluster = self.backend.cluster
        assert cluster is not None and cluster.model is not None
        ranks = [RankInfo(r.rank, r.address, r.blas_label, r.slow_blas) for r in cluster.ranks]
        return BackendReady(cluster.model, ranks, description, cluster.slow_blas_warning(),
                            cluster.transport_label)

    async def on_backend_ready(self, message: BackendReady) -> None:
        self.model = message.model
        self.store.set_model(message.model.name)
        self.failed = False
        self._failed_ranks.clear()
        self.query_one(WorkBar).hide()
        panel = self.query_one(RanksPanel)
        await panel.set_ranks([RankStats(r.rank, r.address, "ready", blas=r.blas, slow_blas=r.slow_blas)
                               for r in message.ranks])
        self.query_one(ThroughputPanel).context_max = message.model.max_context
        self.query_one(RingPanel).transport = message.transport
        name = Path(message.model.name).name or message.model.name
        self.app.sub_title = f"{name} · {len(message.ranks)} ranks"
        if message.description and not self.settings.model:
            self.notify(f"Using {message.description}.", timeout=5)
        if message.blas_warning:
            self.notify(message.blas_warning[0].upper() + message.blas_warning[1:], title="Slow BLAS",
                        severity="warning", timeout=30)
        backend = self.backend
        if backend.cluster is not None and backend.tokenizer is not None:
            backend.session_for(as_sent(self.entries))
            if self._opened:
                self.announce_history_cost(self._opened)
                self._opened = ""
            self.follow_stats(backend.cluster)
            self.count_tokens([c for c in self.query(AttachmentChip) if c.tokens is None])

    def on_backend_failed(self, message: BackendFailed) -> None:
        if message.startup:
            self.app.exit_message = message.message
            self.app.exit(return_code=message.exit_code)
            return
        self.notify(message.message, severity="error", timeout=10)

    @work(thread=True, group="stats", exclusive=True, exit_on_error=False)
    def follow_stats(self, cluster: Cluster) -> None:
        """Forward the ranks' stats; they arrive only when something changed."""
        self._stats_stop.set()  # end the previous cluster's stream, if any
        stop = self._stats_stop = threading.Event()
        try:
            for stats in cluster.stats(interval_s=0.25, stop=stop):
                if stop.is_set():
                    break
                self.post_message(StatsArrived(stats))
        except Exception as e:  # the stream of a dying cluster; the rows already show it
            self.post_message(Notice(f"rank stats stopped: {e}", "warning"))

    def on_stats_arrived(self, message: StatsArrived) -> None:
        if not self.is_mounted:
            return  # the stats thread outlived the screen (quitting)
        stats = message.stats
        panel = self.query_one(RanksPanel)
        panel.update_stats(stats)
        if stats.state == "failed":
            if stats.rank not in self._failed_ranks:
                self._failed_ranks.add(stats.rank)
                self._report_failure(stats.error or f"rank {stats.rank} ({stats.address}) failed")
            return
        if stats.ring_steps:
            self._ring_steps[stats.rank] = stats
            steps = [s for st in self._ring_steps.values() for s in st.ring_steps]
            self.query_one(RingPanel).show_pass(stats.algorithm, steps)
        self.query_one(ThroughputPanel).context_used = panel.total_kv_tokens

    def _report_failure(self, text: str) -> None:
        self.failed = True
        cluster = self.backend.cluster
        hint = " Press Ctrl+R to relaunch the ranks." if cluster is None or cluster.is_local else ""
        self.notify(f"{text}.{hint}", title="Rank failed", severity="error", timeout=30)

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def relaunch(self) -> None:
        """Replace the ranks with fresh local ones; the conversation is re-prefilled next turn."""
        self._stats_stop.set()
        try:
            self.backend.relaunch(self._report)
            if not self.backend.closing.is_set():
                self.post_message(self._ready_message())
                self.post_message(Notice("Ranks relaunched; the next turn re-reads the conversation."))
        except (BackendError, BadInput) as e:
            self.post_message(WorkProgress("connect", 0, 0))
            self.post_message(BackendFailed(f"relaunch failed: {e}"))

    def on_work_progress(self, message: WorkProgress) -> None:
        bar = self.query_one(WorkBar)
        if message.total <= 0 or (message.phase != "prefill" and message.done >= message.total):
            bar.hide()
        else:
            label = message.label or WORK_LABELS.get(message.phase, message.phase)
            expected = self._prefill_expected if message.phase == "prefill" else None
            bar.show(message.phase, label, message.done, message.total, expected_s=expected)

    def on_unmount(self) -> None:
        """Stop everything that waits on the ranks; close the ranks we launched."""
        self._stats_stop.set()
        self.store.flush()
        self.backend.close(generating=self.busy)

    # ---- a turn

    @on(ChatInput.Submitted)
    async def on_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        prompt = self.query_one(ChatInput)
        if text.startswith("/") and await self._slash_command(text):
            prompt.remember(text)
            prompt.clear()
            return
        chips = self.query_one(AttachmentBar).chips()
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
        self._preparing = True
        self.prepare_turn(event.text, text, [c.document for c in chips])

    @work(thread=True, group="prepare", exit_on_error=False)
    def prepare_turn(self, typed: str, text: str, documents: list[Document]) -> None:
        """Tokenize the prompt off the loop (a long document takes seconds) and estimate its prefill."""
        session = self.backend.session
        assert session is not None
        try:
            turn = session.prepare(text, documents)
        except BadInput as e:
            self.post_message(Notice(str(e), "error"))
            self.post_message(TurnPrepared(typed, None))
            return
        self.post_message(TurnPrepared(typed, turn, session.prefill_estimate_s(turn)))

    async def on_turn_prepared(self, message: TurnPrepared) -> None:
        self._preparing = False
        turn = message.turn
        if turn is None or self.backend.session is None:
            return
        if self.backend.session.fits(turn):
            await self._send(message, past_context=False)
            return
        chips = self.query_one(AttachmentBar).chips()

        async def decided(choice: str | None) -> None:
            if choice == "send":
                await self._send(message, past_context=True)
            elif choice and choice.startswith("remove:"):
                await self.query_one(AttachmentBar).remove_chip(chips[int(choice.partition(":")[2])])
                self.post_message(ChatInput.Submitted(message.typed))

        attachments = [(c.document.name, c.tokens) for c in chips]
        budget = ContextBudget(len(turn.tokens), self.backend.session.context_limit, attachments)
        self.app.push_screen(budget, decided)

    async def _send(self, message: TurnPrepared, past_context: bool) -> None:
        turn = message.turn
        assert turn is not None
        prompt = self.query_one(ChatInput)
        entry = Entry("user", message.typed.strip(), turn.content, turn.docs)
        prompt.remember(message.typed)
        prompt.clear()
        await self.query_one(AttachmentBar).clear()
        await self.show_turn(entry)
        self._prefill_expected = message.expected_s
        if self.backend.session is not None:
            self.post_message(WorkProgress("prefill", 0, self.backend.session.new_tokens(turn)))
        self.generate(turn, entry, past_context)

    async def show_turn(self, entry: Entry) -> None:
        """Show the user's message and an empty answer that tokens will stream into."""
        self.entries.append(entry)
        transcript = self.query_one(Transcript)
        self._answer = ChatMessage("assistant", "")
        self._answer.add_class("-streaming")
        question = shown(entry)
        await transcript.mount_all([question, self._answer])
        self._stream = Markdown.get_stream(self._answer)
        self._answer_text, self._tokens, self._cancelled = "", 0, False
        self._first_token_at, self._sent_at = 0.0, time.monotonic()
        self.busy = True
        transcript.scroll_end(animate=False)

    @work(thread=True, group="generate", exclusive=True, exit_on_error=False)
    def generate(self, turn: Turn, entry: Entry, past_context: bool) -> None:
        """Run a turn; every event becomes a message. Tokens are saved before they are shown."""
        session = self.backend.session
        assert session is not None
        self.store.add(entry)
        streamed = False
        try:
            for event in session.run(turn, past_context):
                if isinstance(event, Token):
                    streamed = True
                    self.store.delta(event.text)
                    self.post_message(TokensArrived(event.text, 1))
                elif isinstance(event, Progress):
                    self.post_message(WorkProgress("prefill", event.processed, event.total - event.cached))
                elif isinstance(event, Prefill):
                    self.post_message(PrefillDone(event, session.last_choice))
                elif isinstance(event, Done):
                    self.store.usage(event.prompt_tokens, event.generated_tokens)
                    self.post_message(TurnFinished(done=event, cancelled=self._cancelled))
        except (BackendError, BadInput) as e:
            self.post_message(TurnFinished(error=str(e), cancelled=self._cancelled))
        except Exception as e:  # an unexpected client error must not take the transcript down
            self.post_message(TurnFinished(error=f"{type(e).__name__}: {e}"))
        finally:
            if streamed:
                self.store.end()

    def on_prefill_done(self, message: PrefillDone) -> None:
        self.query_one(WorkBar).hide()
        p = message.prefill
        if message.choice is not None:
            self.query_one(RingPanel).choice = message.choice
        self.query_one(RingPanel).linear = p.linear_layers
        if p.ms > 0:
            self.query_one(ThroughputPanel).prefill_tps = p.new_tokens / (p.ms / 1000)

    async def on_tokens_arrived(self, message: TokensArrived) -> None:
        now = time.monotonic()
        if not self._tokens:
            self._first_token_at = now
            # time to first token as seen here; Done brings the client's own figure
            self.query_one(ThroughputPanel).ttft_ms = 1000 * (now - self._sent_at)
        self._tokens += message.count
        self._answer_text += message.text
        if self._stream is not None:
            await self._stream.write(message.text)
        if self._tokens > 1 and now > self._first_token_at:
            self.query_one(ThroughputPanel).decode_tps = (self._tokens - 1) / (now - self._first_token_at)

    async def on_turn_finished(self, message: TurnFinished) -> None:
        self.query_one(WorkBar).hide()
        answer, stream = self._answer, self._stream
        self._stream = None
        if stream is not None:
            await stream.stop()
        if answer is not None:
            answer.remove_class("-streaming")
            await answer.update(self._answer_text or ("*(no answer)*" if not message.error else ""))
            if message.cancelled:
                answer.border_subtitle = "stopped"
            if message.error:
                answer.border_subtitle = "interrupted"
                answer.add_class("-error")
        # A failed turn without an answer keeps its user message on screen (the client dropped it
        # from the model's history).
        if self._answer_text or message.done is not None:
            self.entries.append(Entry("assistant", self._answer_text))
        if message.done is not None:
            done = message.done
            panel = self.query_one(ThroughputPanel)
            panel.ttft_ms = done.ttft_ms
            if done.decode_tokens_per_s:
                panel.decode_tps = done.decode_tokens_per_s
            panel.context_used = sum(r.kv_tokens for r in done.ranks)
            self.turns_done += 1
        if message.error:
            cluster = self.backend.cluster
            failed = [r.rank for r in cluster.ranks if r.state == "failed"] if cluster is not None else []
            if failed:
                self.query_one(RanksPanel).mark("failed", message.error, failed)
                self._failed_ranks.update(failed)
                self._report_failure(message.error)
            elif not self.failed:  # a failed rank was already reported by its stats stream
                self.notify(message.error, severity="error", timeout=10)
        self.busy = False
        self._answer = None

    def on_notice(self, message: Notice) -> None:
        self.notify(message.text, severity=message.severity, timeout=message.timeout)  # type: ignore[arg-type]

    def action_stop(self) -> None:
        """Esc: stop the reading of a document, or the answer now (what arrived stays)."""
        if self._reading is not None:
            self._reading.set()
            return
        if not self.busy or self.backend.session is None:
            return
        self._cancelled = True
        threading.Thread(target=self.backend.session.cancel, name="cancel", daemon=True).start()

    def watch_busy(self, busy: bool) -> None:
        self.query_one(ChatInput).set_class(busy, "-busy")
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return True if self.busy or self._reading is not None else None
        if action == "relaunch":
            return self.failed
        return True

    # ---- attachments

    @on(ChatInput.PathsDropped)
    def on_paths_dropped(self, event: ChatInput.PathsDropped) -> None:
        self.attach_paths(event.paths)

    @work(thread=True, group="attach", exit_on_error=False)
    def attach_paths(self, paths: list[Path]) -> None:
        """Read each document off the loop, with progress; a bad one becomes a notice, never a
        crash, and Esc stops the reading (of this path and the rest)."""
        cancel = self._reading = threading.Event()
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
            self._reading = None
            self.post_message(WorkProgress("read", 0, 0))

    def _read_progress(self, name: str):
        """Reports of pages or files read, at most ten a second."""
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or done == total:
                last[0] = now
                self.post_message(WorkProgress("read", done, total, f"Reading {name}"))

        return report

    def _count(self, document: Document) -> int | None:
        tokenizer = self.backend.tokenizer
        return len(tokenizer.encode(render_sections(document))) if tokenizer is not None else None

    @work(thread=True, group="attach", exit_on_error=False)
    def count_tokens(self, chips: list[AttachmentChip]) -> None:
        for chip in chips:
            tokens = self._count(chip.document)
            self.app.call_from_thread(setattr, chip, "tokens", tokens)

    async def on_document_read(self, message: DocumentRead) -> None:
        bar = self.query_one(AttachmentBar)
        path = message.path.resolve()
        if bar.has(path):
            self.notify(f"{message.document.name} is already attached.")
            return
        await bar.add(AttachmentChip(path, message.document, message.tokens))
        limit = self.model.max_context if self.model else 0
        if message.tokens and limit and message.tokens > limit:
            self.notify(f"{message.document.name} has {message.tokens:,} tokens, more than the model's "
                        f"{limit:,}-token context.", severity="warning")

    def on_attachment_chip_show(self, message: AttachmentChip.Show) -> None:
        self.app.push_screen(AttachmentsScreen([(message.chip.document, message.chip.tokens)]))

    def action_list_attachments(self) -> None:
        chips = self.query_one(AttachmentBar).chips()
        self.app.push_screen(AttachmentsScreen([(c.document, c.tokens) for c in chips]))

    async def on_attachment_chip_remove(self, message: AttachmentChip.Remove) -> None:
        await self.query_one(AttachmentBar).remove_chip(message.chip)
        self.query_one(ChatInput).focus()

    async def _slash_command(self, text: str) -> bool:
        """Run `/name [argument]` from the command table; False when it names no command."""
        parsed = parse_slash(text)
        if parsed is None:
            return False
        command, argument = parsed
        self.run_command(command, argument)
        return True

    def run_command(self, command: Command, argument: str = "") -> None:
        owner, _, name = command.action.rpartition(".")
        action = getattr(self.app if owner == "app" else self, f"action_{name}")
        if argument and command.argument:
            action(argument)
        else:
            action()

    def action_attach_file(self, paths: str = "") -> None:
        """Attach the paths given (as a paste would write them), or pick one."""
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

    # ---- palette actions

    def system_commands(self) -> Iterator[SystemCommand]:
        """The palette's commands, from the command table (the app adds Textual's own)."""
        for command in COMMANDS:
            if command.name == "algorithm":  # one entry per choice: the palette takes no argument
                for algorithm in ALGORITHMS:
                    yield SystemCommand(f"Algorithm: {algorithm}", f"Use {algorithm} for the ring from the "
                                        "next turn", lambda a=algorithm: self.action_set_algorithm(a))
            else:
                yield SystemCommand(command.title, command.help, lambda c=command: self.run_command(c))

    def action_set_algorithm(self, algorithm: str = "") -> None:
        if algorithm not in ALGORITHMS:
            self.notify(f"Usage: /algorithm {'|'.join(ALGORITHMS)}", severity="warning")
            return
        self.settings = replace(self.settings, algorithm=algorithm)
        if self.backend.session is not None:
            self.backend.session.algorithm = algorithm
        self.query_one(RingPanel).mode = algorithm
        self.notify(f"Ring algorithm: {algorithm}")

    def action_clear(self) -> None:
        if self.busy:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.reset_conversation()

    @work(thread=True, group="backend", exit_on_error=False)
    def reset_conversation(self) -> None:
        if self.backend.session is not None and not self.failed:
            try:
                self.backend.session.reset()
            except BackendError as e:
                self.post_message(Notice(f"could not reset the ranks: {e}", "error"))
                return
        elif self.backend.session is not None:
            self.backend.session.messages.clear()
        self.post_message(ConversationCleared())

    async def on_conversation_cleared(self, message: ConversationCleared) -> None:
        await self.query_one(Transcript).remove_children()
        self.entries.clear()
        self.store.clear()
        self.query_one(RingPanel).choice = None
        panel = self.query_one(ThroughputPanel)
        panel.ttft_ms = panel.prefill_tps = panel.decode_tps = None
        self.notify("Conversation cleared.")

    def export_markdown(self) -> str:
        parts = ["# cpchat transcript\n"]
        for e in self.entries:
            head = "## You" if e.role == "user" else "## Assistant"
            docs = f"\n\n*attached: {', '.join(e.docs)}*" if e.docs else ""
            parts.append(f"{head}\n\n{e.text}{docs}\n")
        return "\n".join(parts)

    def action_export(self) -> Path | None:
        folder = data_dir() / "exports"
        path = folder / time.strftime("cpchat-%Y%m%d-%H%M%S.md")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(self.export_markdown(), encoding="utf-8")
        except OSError as e:
            self.notify(f"could not export: {e}", severity="error")
            return None
        self.notify(f"Transcript exported to {path}", timeout=8)
        return path

    def action_switch_model(self, model: str | None = None) -> None:
        """Load another model on every rank (asking which when not given); the transcript stays."""
        cluster = self.backend.cluster
        if self.busy or cluster is None or cluster.model is None:
            self.notify("Wait for the ranks to be ready and the answer to end.", severity="warning")
            return
        if model is None:
            current = cluster.model.name
            self.app.push_screen(ModelPrompt(current), lambda m: m and self.action_switch_model(m))
            return
        self.busy = True
        self.switch_model(model)

    @work(thread=True, group="backend", exclusive=True, exit_on_error=False)
    def switch_model(self, model: str) -> None:
        """Every rank loads `model` from its own disk; on failure they go back to the old one. The
        next turn re-reads the conversation with the new model."""
        try:
            self.backend.switch_model(model, self._report)
            self._post_notes()
        except BadInput as e:
            self.post_message(Notice(f"could not switch to {model}: {e}", "error"))
            self.post_message(self._ready_message())
            self.post_message(ModelSwitched(None))
            return
        except BackendError as e:
            self.post_message(BackendFailed(f"could not switch to {model}: {e}"))
            self.post_message(ModelSwitched(None))
            return
        self.post_message(self._ready_message())
        self.post_message(ModelSwitched(model))

    def on_model_switched(self, message: ModelSwitched) -> None:
        self.busy = False
        if message.model is not None:
            self.notify(f"Switched to {message.model}; the next turn re-reads the conversation.")

    def action_relaunch(self) -> None:
        if self.busy:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        if self.backend.cluster is not None and not self.backend.cluster.is_local:
            self.notify("These ranks were attached, not launched: restart them on their machines.",
                        severity="warning")
            return
        self.query_one(RanksPanel).mark("starting")
        self.relaunch()

    # ---- conversations

    def action_conversations(self) -> None:
        if self.busy:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.app.push_screen(ConversationsScreen(self.store.directory, self.store.path),
                             lambda path: path and self.open_conversation(path))

    @work(group="conversation", exclusive=True, exit_on_error=False)
    async def open_conversation(self, path: Path) -> None:
        """Show a saved conversation and go on with it: the next turn re-reads it on the ranks."""
        try:
            entries = TranscriptStore.load(path)
        except OSError as e:
            self.notify(f"cannot open {path.name}: {e.strerror}", severity="error")
            return
        transcript = self.query_one(Transcript)
        await transcript.remove_children()
        await transcript.mount_all(shown(e) for e in entries)
        self.entries = entries
        self.store.path = path
        if self.model is not None:
            self.store.set_model(self.model.name)
        session = self.backend.session
        if session is not None:
            session.messages = as_sent(entries)
            session.attach(session.cluster)  # the ranks hold another conversation, or none
            self.announce_history_cost(path.stem)
        else:
            self._opened = path.stem  # announced once the ranks are ready


    @work(thread=True, group="prepare", exit_on_error=False)
    def announce_history_cost(self, name: str) -> None:
        """What re-reading an opened conversation will cost, said before the next turn pays it."""
        session = self.backend.session
        assert session is not None
        tokens, seconds = session.history_cost()
        cost = f", about {human_duration(seconds)}" if seconds is not None and seconds >= 2 else ""
        self.post_message(Notice(f"Opened {name} ({len(self.entries)} messages, {tokens:,} tokens): the next "
                                 f"turn re-reads it on the ranks{cost}.", timeout=10))
