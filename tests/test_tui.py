"""Pilot tests of the TUI against real local ranks running a small random-weights model.

Random weights answer gibberish, so these check structure: tokens arrived,
rows per rank, KV held, the algorithm shown — never the words.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import DEMO_MODEL
from ggufs import write_gguf
from makedocs import write_pdf
from pilot import (
    RANKS,
    SIZE,
    assistant_messages,
    attach_with_question,
    chips,
    click,
    paste,
    ready,
    run_palette,
    until,
)
from textual.pilot import Pilot
from textual.widgets import Label, Markdown, Static

from cpchat import blas
from cpchat.cli import main
from cpchat.client.cluster import Cluster
from cpchat.client.settings import Settings
from cpchat.client.transcripts import TranscriptStore
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.core.stages import ONE_STAGE, Stages
from cpchat.smallmodels import write_model
from cpchat.tui import chat
from cpchat.tui.app import CpchatApp
from cpchat.tui.chat import ChatScreen
from cpchat.tui.jobs import BackendJobs
from cpchat.tui.screens import (
    AttachmentsScreen,
    AttachTyped,
    ContextBudget,
    ConversationsScreen,
    HelpScreen,
    ModelPicker,
)
from cpchat.tui.widgets import (
    AttachmentBar,
    BigText,
    ChatInput,
    ChatMessage,
    RankRow,
    RingPanel,
    StageMap,
    StatusStrip,
    Transcript,
    Welcome,
    WorkBar,
)
from cpchat.tui.widgets.stage_map import StageCell, StageLine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def model(model_dir) -> Path:
    return model_dir("llama")


@pytest.fixture
def make_app(clusters, model, tmp_path) -> Callable[..., CpchatApp]:
    def make(max_tokens: int = 8, cls: type[CpchatApp] = CpchatApp, path: Path | None = None,
             kv: KVFormat = FULL_PRECISION, stages: Stages = ONE_STAGE, **kwargs) -> CpchatApp:
        """An app on the shared cluster of RANKS ranks, with the llama test model or `path` loaded (its
        K/V kept as `kv` says, its layers over `stages`)."""
        path = path or model
        cluster = clusters.get(RANKS, path, kv=kv, stages=stages)
        return cls(Settings(max_tokens=max_tokens, seed=1), cluster=cluster, model_path=str(path),
                         transcripts=tmp_path / "transcripts", **kwargs)

    return make


async def send(pilot: Pilot, text: str) -> None:
    app = pilot.app
    before = app.chat.turns_done
    prompt = app.query_one(ChatInput)
    prompt.load_text(text)
    prompt.focus()
    await pilot.press("enter")
    await until(pilot, lambda: app.chat.turns_done > before and not app.chat.busy, what="the answer")





class WatchedChat(ChatScreen):
    """Records how much answer text was shown before each token message (streaming, not one block).
    Textual runs ChatScreen.on_tokens_arrived after this one (handlers are dispatched along the MRO)."""

    seen: list[int]

    def on_tokens_arrived(self, message) -> None:
        self.seen = getattr(self, "seen", [])
        self.seen.append(len(self.answer.text))


class WatchedApp(CpchatApp):
    CHAT_SCREEN = WatchedChat


async def test_prompt_streams_answer_and_panels_show_ranks(make_app):
    app = make_app(cls=WatchedApp)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What does the document say?")
        assert len(app.chat.seen) > 1 and app.chat.seen == sorted(app.chat.seen), "tokens arrive one by one"
        answer = assistant_messages(app)[-1]
        last = app.chat.conversation.entries[-1]
        assert last.role == "assistant" and last.text
        assert answer.source == last.text
        rows = list(app.query(RankRow))
        assert len(rows) == RANKS and not app.query_one(StageMap).display  # one stage: no map
        await until(
            pilot,
            lambda: all(r.stats.kv_tokens > 0 and r.stats.state in ("ready", "idle") for r in rows),
            what="every rank idle again with KV",
        )
        assert all(r.stats.kv_bytes > 0 for r in rows)
        assert {r.stats.address for r in rows} == {h.address for h in app.chat.backend.cluster.ranks}
        assert [r.stats.blas for r in rows] == [h.blas_label for h in app.chat.backend.cluster.ranks]
        threads = app.chat.backend.cluster.ranks[0].blas.threads
        assert threads == blas.shared_threads(RANKS)  # the cores shared out between the local ranks
        shown = f"BLAS: {rows[0].stats.blas}, {threads} thread{'s' if threads > 1 else ''}"
        assert rows[0].stats.blas and shown in str(rows[0].render())
        # Each rank's measured speed and its share of the prefill's tokens
        assert [r.speed for r in rows] == pytest.approx(app.chat.backend.cluster.speeds())
        assert all(r.speed > 0 for r in rows) and sum(r.share for r in rows) == pytest.approx(1.0)
        assert f"share {rows[0].share:.0%} · " in str(rows[0].render()) and " tok/s" in str(rows[0].render())
        # At two ranks with no spare core pass-KV and all-gather move the same bytes: the measured
        # latencies pick one.
        assert app.query_one(BigText).text in ("pass_kv", "pass_q", "all_gather")
        words = {"pass_kv": "pass-KV: keys and values travel the ring",
                 "pass_q": "pass-Q: queries travel the ring",
                 "all_gather": "all-gather: every rank's keys and values reach all ranks at once"}
        assert str(app.query_one("#ring-words", Static).render()) == words[app.query_one(BigText).text]
        assert app.chat.backend.session.last_choice.algorithm == app.query_one(BigText).text
        assert app.query_one(RingPanel).border_subtitle == "mode auto · shm"  # local ranks share memory
        from cpchat.tui.widgets import ThroughputPanel

        panel = app.query_one(ThroughputPanel)
        assert panel.ttft_ms and panel.ttft_ms > 0 and panel.prefill_tps and panel.context_used > 0
        # Up recalls the prompt just sent
        await pilot.press("up")
        assert app.query_one(ChatInput).text == "What does the document say?"
        await pilot.press("down")
        assert app.query_one(ChatInput).text == ""
    app.chat.conversation.store.flush()
    saved = TranscriptStore.load(app.chat.conversation.store.path)
    assert [e.role for e in saved] == ["user", "assistant"]
    assert saved[1].text == app.chat.conversation.entries[-1].text


@pytest.mark.slow
async def test_ranks_on_the_reference_blas_are_flagged_with_the_fix(model, tmp_path):
    cluster = Cluster.launch(1, blas_choice="reference")
    try:
        cluster.connect()
        cluster.load(str(model))
        app = CpchatApp(Settings(max_tokens=4, seed=1), cluster=cluster, model_path=str(model),
                        transcripts=tmp_path / "transcripts")
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            warnings = lambda: [n for n in app._notifications if n.title == "Slow BLAS"]  # noqa: E731
            await until(pilot, warnings, what="the warning")
            assert warnings()[0].message.startswith("The ranks multiply with the reference BLAS")
            assert "install a fast one and restart: " in warnings()[0].message
            row = app.query_one(RankRow)
            assert row.stats.slow_blas and "BLAS: reference, 1 thread (slow)" in str(row.render())
    finally:
        cluster.close()


async def test_panels_collapse_on_narrow_terminals_and_ctrl_b_is_remembered(tmp_path):
    def make() -> CpchatApp:
        return CpchatApp(Settings(), start_backend=False, transcripts=tmp_path / "transcripts")

    def shown(app: CpchatApp) -> tuple[bool, bool]:
        return app.query_one("#side").display, app.query_one(StatusStrip).display

    app = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert shown(app) == (False, True)
        assert "ranks" in str(app.query_one(StatusStrip).render())
        await pilot.press("ctrl+b")
        assert shown(app) == (True, False)
    assert json.loads((tmp_path / "tui.json").read_text()) == {"panels": "shown"}
    app = make()
    async with app.run_test(size=(200, 60)) as pilot:  # the choice holds at every width
        await pilot.pause()
        assert shown(app) == (True, False)
        await pilot.press("ctrl+b")
        assert shown(app) == (False, True)
    app = make()
    async with app.run_test(size=(200, 60)) as pilot:
        await pilot.pause()
        assert shown(app) == (False, True)
        await pilot.resize_terminal(80, 24)
        await pilot.press("ctrl+b")
        assert shown(app) == (True, False)


async def test_the_welcome_leaves_with_the_first_turn_and_comes_back_on_ctrl_l(make_app, model):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        welcome = app.query_one(Welcome)
        assert welcome.display and "Starting the ranks" in welcome.text().plain
        await ready(pilot)
        await until(pilot, lambda: welcome.model, what="the model named")
        text = welcome.text().plain
        assert f"{model.name} on {RANKS} ranks" in text and "/attach PATH" in text and "Ctrl+O" in text
        assert "Esc stops" in text and "demo model" not in text, "a test model, not the demo"
        await send(pilot, "Hello")
        assert not welcome.display and app.query_one(Transcript).children[0] is welcome
        await pilot.press("ctrl+l")
        await until(pilot, lambda: not app.query(ChatMessage), what="the conversation cleared")
        assert welcome.display


async def answer_to(pilot: Pilot, typed: str, choice: str | None = None) -> None:
    """Send `typed`; where it starts with a path, answer the offer to attach it with `choice`."""
    app = pilot.app
    prompt = app.query_one(ChatInput)
    prompt.load_text(typed)
    prompt.focus()
    before = app.chat.turns_done
    await pilot.press("enter")
    if choice is not None:
        await until(pilot, lambda: isinstance(app.screen, AttachTyped), what="the question")
        question = app.screen
        await until(pilot, lambda: question.done and "tok)" in question.question, what="the count")
        assert re.search(r"Attach field notes(\.txt)? \([\d.k]+ tok\) and send\?", question.question)
        await pilot.press(choice)
    await until(pilot, lambda: app.chat.turns_done > before and not app.chat.busy, what="the answer")
    assert not isinstance(app.screen, AttachTyped)


@pytest.mark.slow
async def test_a_typed_path_is_offered_for_attaching(make_app, tmp_path, monkeypatch):
    """A message that starts with an existing file's or folder's path asks; Enter attaches it and sends
    the question, Esc sends the message as typed; a missing path, or a file's bare name, is sent
    without asking."""
    doc = tmp_path / "field notes.txt"
    doc.write_text("The vault code is 4812-KX. " * 40)
    folder = tmp_path / "field notes"
    folder.mkdir()
    (folder / "a.md").write_text("The gate code is 7712-MR.\n")
    monkeypatch.chdir(tmp_path)
    typed = f"'{doc}' What is the code?"
    app = make_app(max_tokens=2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        messages = app.chat.backend.session.messages
        await answer_to(pilot, typed, "enter")
        assert messages[-2].docs == [doc.name] and messages[-2].content.endswith("What is the code?")
        assert "4812-KX" in messages[-2].content and typed not in messages[-2].content
        assert app.chat.conversation.entries[-2].text == "What is the code?" and not chips(app)
        await answer_to(pilot, typed, "escape")
        assert messages[-2].docs == [] and messages[-2].content == typed
        await answer_to(pilot, f"{tmp_path / 'missing.txt'} What is the code?")
        assert messages[-2].docs == []
        await answer_to(pilot, "'field notes.txt' What is the code?")  # here, but no path separator
        assert messages[-2].docs == []
        await answer_to(pilot, "./field\\ notes What is the gate code?", "enter")
        assert messages[-2].docs == ["field notes"] and "7712-MR" in messages[-2].content


async def test_multiline_input_and_history(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.query_one(ChatInput)
        prompt.focus()
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        assert app.chat.turns_done == 0


def drop_forms(a: Path, b: Path) -> dict[str, tuple[str, list[Path]]]:
    """Every way a terminal pastes dropped files."""
    escaped = str(a).replace(" ", "\\ ")
    return {
        "plain": (str(b), [b]),
        "single-quoted": (f"'{a}'", [a]),
        "double-quoted": (f'"{a}"', [a]),
        "backslash-escaped": (escaped, [a]),
        "file-uri": ("file://" + quote(str(a)), [a]),
        "two-files-spaces": (f"{escaped} {b}", [a, b]),
        "two-files-newlines": (f"'{a}'\n{b}\n", [a, b]),
        "two-uris": (f"file://{quote(str(a))} file://{quote(str(b))}", [a, b]),
    }


@pytest.mark.slow
async def test_paste_of_paths_attaches_in_every_form(make_app, tmp_path):
    a = tmp_path / "notes with spaces.txt"
    a.write_text("The vault code is 4812-KX.\n" * 20)
    b = tmp_path / "plain.md"
    b.write_text("# Plain\n\nOrion and Lyra.\n")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for form, (text, expected) in drop_forms(a, b).items():
            await paste(pilot, text)
            count = len(expected)
            await until(pilot, lambda n=count: len(chips(app)) == n, what=f"chips for {form}")
            assert [c.path for c in chips(app)] == [p.resolve() for p in expected], form
            assert all(c.tokens and c.tokens > 0 for c in chips(app)), form
            assert app.query_one(ChatInput).text == "", f"{form} must not insert text"
            for chip in chips(app):
                await click(pilot, chip.query_one(".chip-remove"))
                await until(pilot, lambda c=chip: not c.is_attached, what=f"{form} chip removed")
        # attach both and send: the documents go into the user turn with their names
        await paste(pilot, f"'{a}' '{b}'")
        await until(pilot, lambda: len(chips(app)) == 2)
        await send(pilot, "What is the code?")
        user = app.chat.backend.session.messages[0]
        assert user.docs == [a.name, b.name]
        assert f'<document name="{a.name}">' in user.content and "4812-KX" in user.content
        assert not chips(app)
        first = next(m for m in app.query(ChatMessage) if m.role == "user")
        assert a.name in str(first.border_subtitle)


async def test_non_path_paste_stays_text(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await paste(pilot, "hello world, it's /not/a/file.txt")
        assert app.query_one(ChatInput).text == "hello world, it's /not/a/file.txt"
        assert not chips(app)


async def test_attach_command_and_bad_files(make_app, tmp_path):
    good = tmp_path / "report v2.txt"
    good.write_text("Altair and Vega.\n")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for command in (f"/attach '{good}'", f"/attach {binary}", f"/attach {tmp_path / 'missing.txt'}"):
            app.query_one(ChatInput).load_text(command)
            await pilot.press("enter")
            await until(pilot, lambda: not [w for w in app.workers if w.group == "attach" and w.is_running])
            await pilot.pause()
        assert [c.path for c in chips(app)] == [good.resolve()]
        notes = [n.message for n in app._notifications]
        assert any("looks binary" in n for n in notes) and any("no such file" in n for n in notes)
        assert app.chat.turns_done == 0 and app.query_one(ChatInput).text == ""


@pytest.mark.slow
async def test_dropped_pdf_and_folder_attach_with_format_pages_and_files(make_app, tmp_path):
    pdf = write_pdf(tmp_path / "site report.pdf", ["Opening.", "The vault code is 4812-KX.", "End."])
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / ".gitignore").write_text("*.tmp\n")
    (folder / "a.md").write_text("# A\n")
    (folder / "sub" / "b.txt").write_text("Orion.\n")
    (folder / "scratch.tmp").write_text("ignored\n")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await paste(pilot, f"'{pdf}' {folder}")
        await until(pilot, lambda: len(chips(app)) == 2 and all(c.tokens for c in chips(app)), what="chips")
        captions = [str(c.query_one(".chip-label", Label).render()) for c in chips(app)]
        assert captions[0].startswith("site report.pdf · PDF · 3 pages · ") and captions[0].endswith(" tok")
        assert captions[1].startswith("notes/ · 2 files · ")
        await click(pilot, chips(app)[1].query_one(".chip-label"))
        await until(pilot, lambda: isinstance(app.screen, AttachmentsScreen), what="the folder's listing")
        listing = app.screen.query_one(Markdown).source
        assert "`notes/a.md`" in listing and "`notes/sub/b.txt`" in listing and "scratch" not in listing
        assert "1 file ignored by .gitignore" in listing
        await pilot.press("escape")
        await send(pilot, "What is the vault code?")
        user = app.chat.backend.session.messages[0]
        assert user.docs == ["site report.pdf", "notes"]
        assert "[page 2]\nThe vault code is 4812-KX." in user.content
        assert '<document name="notes/sub/b.txt">\nOrion.\n</document>' in user.content


class SlowReadBar(AttachmentBar):
    """Holds the reading of a document after its first page until the reading is cancelled, so the
    test presses Esc while a read is certainly under way."""

    reading_paused = False

    def _read_progress(self, name: str):
        report = super()._read_progress(name)

        def hold(done: int, total: int) -> None:
            report(done, total)
            if done == 1:
                self.app.call_from_thread(setattr, self, "reading_paused", True)
                self.reading.wait(30)

        return hold


async def test_escape_stops_the_reading_of_a_large_document(make_app, tmp_path, monkeypatch):
    pdf = write_pdf(tmp_path / "big.pdf", [f"Page {i}." for i in range(20)])
    monkeypatch.setattr(chat, "AttachmentBar", SlowReadBar)  # the bar the chat screen composes
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        bar = app.query_one(SlowReadBar)
        await paste(pilot, str(pdf))
        await until(pilot, lambda: bar.reading_paused, what="the reading to start")
        assert app.query_one(WorkBar).display
        await pilot.press("escape")
        await until(pilot, lambda: bar.reading is None, what="the reading to stop")
        await pilot.pause()
        assert not chips(app) and not app.query_one(WorkBar).display
        assert any("Stopped reading big.pdf" in n.message for n in app._notifications)
        assert app.chat.turns_done == 0


@pytest.mark.slow
async def test_a_prompt_past_the_context_asks_first(clusters, tmp_path_factory, tmp_path):
    """The budget dialog: Back keeps everything, Remove drops that attachment and sends, Send anyway sends."""
    short = write_model(tmp_path_factory.mktemp("short") / "llama", "llama", max_position_embeddings=160)
    doc = tmp_path / "long.txt"
    doc.write_text("word " * 200)
    app = CpchatApp(Settings(max_tokens=4, seed=1), cluster=clusters.get(RANKS, short), model_path=str(short),
                    transcripts=tmp_path / "transcripts")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)

        async def ask(attach: bool = True) -> ContextBudget:
            if attach:
                await attach_with_question(pilot, doc, "What is it about?")
            app.query_one(ChatInput).focus()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ContextBudget)
                        and app.screen.query("#budget-numbers"), what="the budget dialog, composed")
            return app.screen

        dialog = await ask()
        assert "the model's context is 160" in str(dialog.query_one("#budget-numbers", Label).render())
        await click(pilot, app.screen.query_one("#back"))
        await pilot.pause()
        assert app.chat.turns_done == 0 and len(chips(app)) == 1
        assert app.query_one(ChatInput).text == "What is it about?"
        await ask(attach=False)
        await click(pilot, app.screen.query_one("#remove-0"))
        chat = app.chat
        await until(pilot, lambda: chat.turns_done == 1 and not chat.busy, what="the turn, no document")
        assert app.chat.backend.session.messages[0].docs == [] and not chips(app)
        await ask()
        await click(pilot, app.screen.query_one("#send"))
        await until(pilot, lambda: chat.turns_done == 2 and not chat.busy, what="the turn sent anyway")
        assert app.chat.backend.session.messages[2].docs == ["long.txt"]
        assert not any(n.severity == "error" for n in app._notifications)
    clusters.drop(RANKS)  # the next test wants its own model on a fresh pool entry


async def test_the_prefill_estimate_counts_down_or_stays_silent():
    from textual.app import App

    class Bar(App):
        def compose(self):
            yield WorkBar()

    async with Bar().run_test() as pilot:
        bar = pilot.app.query_one(WorkBar)
        label = bar.query_one("#work-label", Label)
        bar.show("prefill", "Prefill, layer", 2, 8, expected_s=150)
        assert str(label.render()) == "Prefill, layer 2/8 · about 2 min left"
        bar.hide()
        bar.show("prefill", "Prefill, layer", 2, 8)
        assert str(label.render()) == "Prefill, layer 2/8", "no estimate rather than a wrong one"
        bar.hide()
        bar.show("prefill", "Prefill, layer", 2, 8, expected_s=0.5)
        assert str(label.render()) == "Prefill, layer 2/8"


@pytest.mark.slow
async def test_the_panels_show_each_ranks_stage_and_the_pipelines_wait(make_app):
    app = make_app(stages=Stages(2))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert [row.place for row in app.query(RankRow)] == ["stage 0 · layer 0", "stage 1 · layer 1"]
        assert "stage 1 · layer 1" in str(app.query(RankRow).last().render())
        await send(pilot, " ".join(["word"] * 700))  # long enough to go through the stages in chunks
        assert re.fullmatch(r"2 stages: waited up to [\d,]+ ms \(\d+% of the prefill\)",
                            app.query_one(RingPanel).pipeline)
        stage_map = app.query_one(StageMap)
        await until(pilot, lambda: all(c.kv_tokens for line in stage_map.lines for c in line.cells),
                    what="the map's K/V tokens")
        tokens = [row.stats.kv_tokens for row in app.query(RankRow)]
        assert stage_map.display and stage_map.render().plain.splitlines()[1:] == [
            f"0      ●0 {tokens[0]:<6}", f"1      ●1 {tokens[1]:<6}"]


def test_the_stage_map_is_a_grid_of_stages_by_context_ranks():
    """Four ranks as 2 x 2: a line a stage (its layers), a cell a rank (its K/V tokens)."""
    stage_map = StageMap()
    stage_map.lines = (StageLine(0, 15, (StageCell(0, "idle", 2100), StageCell(1, "busy", 12345))),
                       StageLine(15, 30, (StageCell(2, "idle", 2100), StageCell(3, "failed", 0))))
    assert stage_map.render().plain.splitlines() == [
        "layers tokens →", "0–14   ●0 2100  ●1 12.3k ", "15–29  ●2 2100  ●3 0     "]


def test_a_stats_stream_whose_screen_closed_before_it_started_ends(clusters, model):
    """A screen may close before its stats worker runs; that stream must end all the same (one that
    outlived its app held a thread of each rank's server for good: enough of them, and a Generate
    waited for a thread that never came)."""
    jobs = BackendJobs(None, lambda message: None)
    stop = jobs.stats_stream()  # on the event loop, when the ranks are ready
    jobs.stop_stats()  # the screen closed
    worker = threading.Thread(target=jobs.follow_stats, args=(clusters.get(RANKS, model), stop), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()


@pytest.mark.slow
async def test_escape_stops_the_answer_and_keeps_it(make_app):
    app = make_app(max_tokens=100_000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat.backend.session.sampling.ignore_eos = True  # an answer that cannot end before the Esc
        prompt = app.query_one(ChatInput)
        prompt.load_text("Tell me everything.")
        prompt.focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.conversation.entries, what="the turn to start")
        await until(pilot, lambda: not app.chat.busy or app.chat.answer.tokens >= 3, what="the first tokens")
        assert app.chat.busy, f"the turn ended first: {[n.message for n in app._notifications]}"
        await pilot.press("escape")
        await until(pilot, lambda: not app.chat.busy, timeout=20, what="the stop")
        answer = assistant_messages(app)[-1]
        assert answer.border_subtitle == "stopped"
        last = app.chat.conversation.entries[-1]
        assert last.role == "assistant" and last.text
        assert app.chat.backend.session.messages[-1].content == last.text
        # Counted by the ranks: re-encoding a random model's text does not give back its tokens.
        done = app.chat.side.throughput.done
        assert done is not None and done.generated_tokens < 100_000


@pytest.mark.slow
async def test_palette_actions(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await run_palette(pilot, "Algorithm: pass_q")
        assert app.chat.backend.session.planner.algorithm == "pass_q"
        await send(pilot, "First question")
        assert app.query_one(BigText).text == "pass_q" and app.chat.backend.session.last_choice.forced
        await run_palette(pilot, "Export transcript")
        from cpchat.dirs import data_dir

        exported = sorted((data_dir() / "exports").glob("*.md"))
        assert exported and "First question" in exported[-1].read_text()
        await run_palette(pilot, "Show help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await run_palette(pilot, "Clear conversation")
        await until(pilot, lambda: not app.query(ChatMessage), what="cleared transcript")
        assert app.query_one(Welcome).display, "the welcome is back"
        assert app.chat.backend.session.messages == [] and app.chat.conversation.entries == []
        rows = list(app.query(RankRow))
        await until(pilot, lambda: all(r.stats.kv_tokens == 0 for r in rows), what="KV reset on the ranks")
        await run_palette(pilot, "Attach file")
        assert app.screen.__class__.__name__ == "FilePicker"
        await pilot.press("escape")


async def test_transcript_resumes(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Remember Orion.")
    app.chat.conversation.store.flush()
    again = make_app(resume=app.chat.conversation.store.path)
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = [m.role for m in again.query(ChatMessage)]
        assert shown == ["user", "assistant"]
        resumed = again.chat.backend.session.messages
        assert [m.content for m in resumed] == [e.content for e in app.chat.conversation.entries]
        notes = again._notifications
        await until(pilot, lambda: any("the next turn re-reads it" in n.message for n in notes),
                    what="the cost of re-reading")
        await send(pilot, "And then?")  # re-prefills the resumed conversation
        assert len(again.chat.backend.session.messages) == 4
        assert again.chat.backend.session.last_choice.cached_tokens == 0  # nothing of it was held


@pytest.mark.slow
async def test_a_resumed_conversation_loads_its_saved_prefix(make_app, monkeypatch):
    """The ranks saved the conversation at the end of its turn; reopened (the ranks' memory emptied),
    its next turn loads that from disk instead of re-reading it, and the Ring panel says so."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat.backend.session.save_min_tokens = 0
        await send(pilot, "Remember Orion, the hunter of the winter sky: his belt of three stars, his "
                          "two dogs, and the bull he faces across the river of stars.")
    app.chat.conversation.store.flush()
    again = make_app(resume=app.chat.conversation.store.path)
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert again.chat.backend.session.held.tokens == []
        notes = again._notifications
        await until(pilot, lambda: any("the ranks saved" in n.message for n in notes), what="the saved part")
        bar, labels = again.query_one(WorkBar), []
        show = bar.show
        monkeypatch.setattr(bar, "show", lambda phase, label, *rest, **kw: (labels.append(label),
                                                                           show(phase, label, *rest, **kw)))
        await send(pilot, "And then?")
        assert any(re.fullmatch(r"Loaded \d+ cached tokens in \d+\.\d s · prefill", text) for text in labels)
        choice = again.chat.backend.session.last_choice
        assert choice.cached_tokens > 32
        ring = again.query_one(RingPanel)
        assert ring.cache.startswith(f"cache: {choice.cached_tokens} tok loaded from disk in")
        assert "loaded from disk" in again.query_one(StatusStrip).render().plain


@pytest.mark.slow
async def test_conversation_list_opens_renames_and_deletes(make_app, tmp_path):
    """Two conversations, then the palette's list: rename the first, delete the second, open the first."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "About Orion.")
        first = app.chat.conversation.store.path
        await run_palette(pilot, "Clear conversation")
        await until(pilot, lambda: not app.chat.conversation.entries, what="the clear")
        await send(pilot, "About Lyra.")
        second = app.chat.conversation.store.path
        assert first != second and first.exists()
        await run_palette(pilot, "Conversations")
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        assert [s.path for s in screen.summaries] == [second, first]  # newest first
        assert screen.summaries[1].model == app.chat.model.name and screen.summaries[1].tokens > 0
        await pilot.press("d")  # the open one is refused
        await pilot.pause()
        assert second.exists() and len(screen.summaries) == 2
        await pilot.press("down", "r", *"Orion notes", "enter")
        await pilot.pause()
        assert screen.summaries[1].title == "Orion notes"
        await pilot.press("enter")  # the renamed one stays highlighted
        await until(pilot, lambda: app.chat.conversation.store.path == first, what="the first conversation")
        assert [m.source for m in assistant_messages(app)] == [app.chat.conversation.entries[1].text]
        assert app.chat.conversation.entries[0].text == "About Orion."
        entries = app.chat.conversation.entries
        assert [m.content for m in app.chat.backend.session.messages] == [e.content for e in entries]
        await run_palette(pilot, "Conversations")
        await pilot.press("d")  # the second is not open now
        await pilot.pause()
        assert not second.exists() and [s.path for s in app.screen.summaries] == [first]
        await pilot.press("escape")
        shown = list(app.chat.conversation.entries)
        app.chat.open_conversation(second)  # deleted meanwhile: said, and the open one stays
        await until(pilot, lambda: any("cannot open" in n.message for n in app._notifications),
                    what="the error")
        assert app.chat.conversation.entries == shown and app.chat.conversation.store.path == first


@pytest.mark.slow
async def test_model_switch_reloads_every_rank_and_keeps_the_conversation(make_app, clusters, model_dir):
    app = make_app()
    other = model_dir("qwen3")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "First question")
            chat, backend, notes = app.chat, app.chat.backend, app._notifications
            app.query_one(ChatInput).load_text("/model")  # without a model it asks which
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the model picker")
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is chat, what="back to the chat")
            app.query_one(ChatInput).load_text("/model /no/such/model")
            await pilot.press("enter")
            await until(pilot, lambda: any("could not switch to /no/such/model" in n.message for n in notes),
                        what="the refusal")
            await until(pilot, lambda: not chat.busy, what="the ranks ready again")
            assert backend.cluster.model.model_type == "llama"
            app.query_one(ChatInput).load_text(f"/model {other}")
            await pilot.press("enter")
            await until(pilot, lambda: backend.cluster.model.model_type == "qwen3" and not chat.busy,
                        timeout=90, what="the switch")
            assert "qwen3" in app.sub_title and len(app.query(ChatMessage)) == 2
            await send(pilot, "Second question")  # the new model re-reads the first turn
            assert len(backend.session.messages) == 4 and backend.session.tokenizer is backend.tokenizer
            assert backend.session.last_choice.cached_tokens == 0
    finally:
        clusters.loaded.pop((RANKS, "auto"), None)  # the ranks hold qwen3 now


def test_print_config_and_startup_failure(capsys, monkeypatch):
    monkeypatch.setenv("CPCHAT_MAX_TOKENS", "77")
    assert main(["--print-config", "--ranks", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ranks +=\s3 .*# flag --ranks$", out, re.M) and "CPCHAT_MAX_TOKENS" in out
    assert re.search(r"^cache +=\sTrue .*# default$", out, re.M)
    assert main(["--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cpchat: model path /no/such/model does not exist"]


@pytest.mark.slow
async def test_dead_rank_turns_red_and_relaunch_continues(make_app, clusters):
    """Runs last: it breaks the shared cluster on purpose and drops it."""
    app = make_app()
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "Before the failure.")
            app.chat.backend.cluster.ranks[1].local.process.kill()
            rows = list(app.query(RankRow))
            await until(pilot, lambda: rows[1].stats.state == "failed", timeout=30, what="the failed row")
            assert rows[1].has_class("-failed")
            assert any(n.title == "Rank failed" for n in app._notifications)
            assert len(app.query(ChatMessage)) == 2, "the transcript stays"
            await pilot.press("ctrl+r")
            chat = app.chat
            await until(pilot, lambda: not chat.failed and chat.backend.own_cluster, timeout=90,
                        what="relaunch")
            await until(pilot, lambda: [r.stats.state for r in app.query(RankRow)] == ["ready", "ready"],
                        what="exactly the new ring's two rows, ready")
            await send(pilot, "After the relaunch.")
            await until(pilot, lambda: all(r.stats.kv_tokens > 0 for r in app.query(RankRow)),
                        what="KV after re-prefill")
            assert len(app.chat.backend.session.messages) == 4
    finally:
        clusters.drop(RANKS)


class ProgressChat(ChatScreen):
    """Records the phases of long work the screen showed."""

    def on_work_progress(self, message) -> None:
        self.phases = getattr(self, "phases", [])
        self.phases.append((message.phase, message.done, message.total))


class ProgressApp(CpchatApp):
    CHAT_SCREEN = ProgressChat


@pytest.mark.slow
async def test_hub_model_downloads_with_progress_then_answers(model, tmp_path, monkeypatch):
    """`--model ORG/NAME` not yet in the hub cache: the app downloads it (the one stubbed part: the
    network; the files land in a real hub cache layout) with progress in the work bar, then its own
    local ranks load the id from that cache, offline, and answer."""
    import shutil

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the ranks must find the model in the cache
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False,
                          tqdm_class=None):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached yet")
        bar = tqdm_class(total=3 << 20, unit="B")
        for _ in range(3):
            bar.update(1 << 20)
        bar.close()
        shutil.copytree(model, repo / "snapshots" / ("a" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("a" * 40)
        return str(repo / "snapshots" / ("a" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    app = ProgressApp(Settings(model="acme/tiny-chat", ranks=RANKS, max_tokens=4, seed=1),
                      transcripts=tmp_path / "transcripts")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert [p for p in app.chat.phases if p[0] == "download"] == [("download", n, 3) for n in (1, 2, 3)]
        assert "tiny-chat" in app.sub_title
        await send(pilot, "hello")
        assert assistant_messages(app) and app.chat.backend.cluster.model.name == "acme/tiny-chat"


@pytest.mark.slow
async def test_a_gguf_model_is_converted_with_progress_then_answers(model_dir, tmp_path):
    """`--model FILE.gguf`: converted once, with its progress in the work bar and a notice saying where
    to; then the local ranks load it and answer."""
    gguf = write_gguf(model_dir("llama"), tmp_path / "tiny.gguf", "Q8_0")
    app = ProgressApp(Settings(model=str(gguf), ranks=RANKS, max_tokens=4, seed=1),
                      transcripts=tmp_path / "transcripts")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        converted = [p for p in app.chat.phases if p[0] == "convert"]
        assert converted and converted[-1][1] == converted[-1][2] > 0
        notes = [n.message for n in app._notifications]
        assert any(note.startswith("Converting tiny.gguf to an mlx-lm model") for note in notes)
        assert "tiny.gguf" in app.sub_title
        await send(pilot, "hello")
        assert assistant_messages(app)


@pytest.mark.slow
async def test_a_hybrid_model_shows_its_state_and_how_linear_layers_ran(make_app, model_dir):
    """Qwen3.5's Gated DeltaNet layers through the ranks: each Ranks row shows the recurrent state's bytes
    beside the KV, and the Ring panel says how the linear layers crossed the ring."""
    app = make_app(max_tokens=4, path=model_dir("qwen3_5"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is the state of the ring?")
        rows = list(app.query(RankRow))
        await until(pilot, lambda: all(r.stats.state_bytes > 0 for r in rows), what="state bytes")
        assert all("state " in str(r.render()) for r in rows)
        assert "layers linear (gated_delta_update)" in str(app.query_one("#ring-reason").render())


@pytest.mark.slow
async def test_quantized_kv_shows_its_packed_bytes(make_app):
    """--kv-bits 4: the Ranks panel says so and shows each rank's packed K/V bytes (the demo model: 6 layers
    of 6 heads, 32 wide, keys and values at half a byte a value and a float32 scale and bias per 32)."""
    app = make_app(max_tokens=4, path=DEMO_MODEL, kv=KVFormat(4, 32, 0))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Where is the lighthouse?")
        rows = list(app.query(RankRow))
        await until(pilot, lambda: all(r.stats.kv_tokens > 0 for r in rows), what="K/V in every row")
        assert app.query_one("#ranks").border_subtitle == "K/V 4-bit"
        assert all(r.stats.kv_bytes == r.stats.kv_tokens * 6 * 2 * 6 * 32 * 0.75 for r in rows)
