"""Snapshots of the main TUI states, frozen by posting the backend's messages ourselves.

No ranks, clocks, pids or real addresses: every number on screen comes from
the fixed messages below, so the SVGs are stable. Update with
`pytest tests/test_tui_snapshots.py --snapshot-update` after a deliberate change.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpchat.client.documents import Document, Section
from cpchat.client.events import AlgorithmChoice, Prefill, RankStats, RingStep
from cpchat.client.ranks import ServedModel
from cpchat.client.settings import Settings, bundled
from cpchat.client.transcripts import Entry
from cpchat.tui.app import CpchatApp
from cpchat.tui.messages import (
    BackendReady,
    DocumentRead,
    PrefillDone,
    RankInfo,
    StatsArrived,
    TokensArrived,
    TurnFinished,
    WorkProgress,
)
from cpchat.tui.screens import ContextBudget
from cpchat.tui.widgets import ChatInput, ThroughputPanel

SIZE = (140, 44)
MODEL = ServedModel("demo-model", "llama", 4, 4, 2, 512, 4, 131072)
RANKS = [RankInfo(0, "127.0.0.1:7070"), RankInfo(1, "127.0.0.1:7071")]
DOC_TEXT = "Chapter 1\n\nThe vault code is 4812-KX.\n" * 300
CHOICE = AlgorithmChoice("pass_kv", False, 9120, 0, 1.0,
                         {"pass_kv": 812.0, "pass_q": 1460.0, "all_gather": 845.0, "ulysses": 930.0},
                         "least estimated: pass-KV 812 ms, all-gather 845 ms", 9.1e8, 1.2, 1.6)
ANSWER = (
    "The document says the vault code is **4812-KX**. It appears in every chapter:\n\n"
    "| chapter | code |\n|---|---|\n| 1 | 4812-KX |\n\n"
    "```python\ncode = \"4812-KX\"\n"
)


def steps(rank: int) -> list[RingStep]:
    return [RingStep(layer, step, 3.0 + step + rank, 0.5 + 2 * step, 262144)
            for layer in range(4) for step in range(2)]


def stats(rank: int, state: str, kv_tokens: int, error: str = "") -> RankStats:
    return RankStats(rank, RANKS[rank].address, state, kv_tokens=kv_tokens, kv_bytes=kv_tokens * 512,
                     rss_bytes=420 << 20, mlx_active_bytes=96 << 20, mlx_peak_bytes=160 << 20,
                     peak_rss_bytes=440 << 20, algorithm="pass_kv",
                     ring_steps=steps(rank) if kv_tokens else [], error=error)


def make_app() -> CpchatApp:
    return CpchatApp(Settings(), start_backend=False, transcripts=Path("/nonexistent/cpchat-snapshots"))


async def ready(pilot) -> None:
    app: CpchatApp = pilot.app
    await pilot.pause()  # the chat screen composes once the app runs
    app.query_one(ChatInput).cursor_blink = False
    app.chat.post_message(BackendReady(MODEL, RANKS))
    await pilot.pause()
    for rank in (0, 1):
        app.chat.post_message(StatsArrived(stats(rank, "ready", 0)))
    await pilot.pause()


async def attach(pilot) -> None:
    await ready(pilot)
    pdf = Document("vault manual.pdf", "PDF", 48213, (Section("vault manual.pdf", DOC_TEXT),), 24, "pages")
    files = tuple(Section(f"site-notes/{i}.md", "x") for i in range(7))
    folder = Document("site-notes", "folder", 20480, files, left_out=("2 files ignored by .gitignore",))
    pilot.app.chat.post_message(DocumentRead(Path("/docs/vault manual.pdf"), pdf, 9104))
    pilot.app.chat.post_message(DocumentRead(Path("/docs/site-notes"), folder, 5120))
    pilot.app.query_one(ChatInput).load_text("What is the vault code?")
    await pilot.pause()


async def past_context(pilot) -> None:
    await attach(pilot)
    pilot.app.push_screen(ContextBudget(140312, 131072, [("vault manual.pdf", 9104), ("site-notes", 131000)]))
    await pilot.pause()


async def mid_answer(pilot) -> None:
    app: CpchatApp = pilot.app
    await ready(pilot)
    entry = Entry("user", "What is the vault code?", "…", ["vault manual.txt"])
    await app.chat.show_turn(entry)
    app.chat.post_message(WorkProgress("prefill", 4, 4))
    app.chat.post_message(PrefillDone(Prefill(0, 9120, 0, "pass_kv", 1824.0), CHOICE))
    for rank, kv in ((0, 4566), (1, 4570)):
        app.chat.post_message(StatsArrived(stats(rank, "busy", kv)))
    app.chat.post_message(TokensArrived(ANSWER, 1))
    await pilot.pause()
    await pilot.pause()
    panel = app.query_one(ThroughputPanel)
    panel.ttft_ms, panel.decode_tps = 1902.4, 41.3
    await pilot.pause()


async def failed_rank(pilot) -> None:
    app: CpchatApp = pilot.app
    await mid_answer(pilot)
    app.chat.post_message(StatsArrived(stats(1, "failed", 0, "rank 1 (127.0.0.1:7071) stopped answering")))
    app.chat.post_message(TurnFinished(error="rank 1 (127.0.0.1:7071) stopped answering during decode"))
    await pilot.pause()
    await pilot.pause()


def test_snapshot_empty(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=ready)


def test_snapshot_document_attached(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=attach)


def test_snapshot_past_context(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=past_context)


def test_snapshot_mid_answer(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=mid_answer)


def test_snapshot_failed_rank(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=failed_rank)


@pytest.mark.parametrize("size", [(80, 24), (140, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_snapshot_welcome_to_the_demo_model(snap_compare, monkeypatch, size):
    """The first screen a new user sees: the demo model on 2 ranks, with the sample to try (its path
    as typed from the repository's root)."""
    monkeypatch.chdir(bundled("sample-doc.txt").parent.parent)
    demo = ServedModel(str(bundled("demo-model")), "llama", 6, 6, 6, 4096, 4, 131072)

    async def run_before(pilot) -> None:
        await pilot.pause()
        pilot.app.query_one(ChatInput).cursor_blink = False
        pilot.app.chat.post_message(BackendReady(demo, RANKS))
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40), (200, 60)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("toggled", [False, True], ids=["as-opened", "ctrl-b"])
def test_snapshot_sizes(snap_compare, tmp_path, size, toggled):
    """Below 110 columns the panels open collapsed to the strip and Ctrl+B shows them; above, the
    other way round."""

    async def run_before(pilot) -> None:
        await mid_answer(pilot)
        if toggled:
            await pilot.press("ctrl+b")
            await pilot.pause()

    app = CpchatApp(Settings(), start_backend=False, transcripts=tmp_path / "transcripts")
    assert snap_compare(app, terminal_size=size, run_before=run_before)
