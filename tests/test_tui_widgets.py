"""Widgets that own their arithmetic, each mounted alone in a host app: no ranks, no chat screen."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.app import App, ComposeResult

from cpchat.client.events import Done, Prefill, RankUsage, RingStep, Speculated
from cpchat.tui.jobs import AnswerText
from cpchat.tui.messages import TokensArrived
from cpchat.tui.widgets import Answer, ThroughputPanel
from cpchat.tui.widgets.answer import Pace
from cpchat.tui.widgets.ring_chart import RingChart

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _text(widget) -> str:
    console = Console(width=60, file=io.StringIO())
    console.print(widget.render())
    return console.file.getvalue()


async def test_the_throughput_panel_computes_its_rates_from_what_it_is_handed():
    class Host(App):
        def compose(self) -> ComposeResult:
            yield ThroughputPanel()

    async with Host().run_test() as pilot:
        panel = pilot.app.query_one(ThroughputPanel)
        panel.prefill = Prefill(0, 2000, 0, "pass_kv", 500.0)
        assert panel.prefill_tps == 4000
        panel.pace = Pace(first_token_s=0.25, tokens=1, decoding_s=0.0)
        assert panel.ttft_ms == 250 and panel.decode_tps is None  # one token: no rate yet
        panel.pace = Pace(first_token_s=0.25, tokens=11, decoding_s=2.0)
        assert panel.decode_tps == 5.0
        ranks = [RankUsage(0, 1000, 1 << 20, 0), RankUsage(1, 1011, 1 << 20, 0)]
        panel.done = Done(0, 2000, 11, 240.0, 0.0, ranks)  # the client's figures win, where it has them
        assert panel.ttft_ms == 240 and panel.decode_tps == 5.0 and panel.context_used == 2011
        assert panel.speculation is None and "tok/step" not in _text(panel)
        panel.done = Done(0, 2000, 11, 240.0, 9.0, ranks, Speculated("lookup", 12, 6, 4))
        await pilot.pause()
        assert "lookup  2.5 tok/step, 50% taken" in _text(panel)  # 10 tokens after the first, in 4 steps
        panel.clear()
        assert (panel.ttft_ms, panel.prefill_tps, panel.decode_tps, panel.speculation) == (None,) * 4


async def test_an_answer_keeps_its_text_and_its_pace_and_says_how_it_ended():
    class Host(App):
        def compose(self) -> ComposeResult:
            yield Answer()

    async with Host().run_test() as pilot:
        answer = pilot.app.query_one(Answer)
        answer.start()
        await answer.write("The code ", 2)
        await answer.write("is 4812-KX.", 3)
        assert answer.text == "The code is 4812-KX." and answer.pace.tokens == 5
        assert answer.pace.first_token_s >= 0 and answer.pace.decoding_s >= 0
        await answer.finish(cancelled=True, failed=False)
        assert answer.source == "The code is 4812-KX." and answer.border_subtitle == "stopped"
        assert not answer.has_class("-streaming")


async def test_the_ring_chart_says_when_a_decode_step_crossed_nothing_per_layer():
    class Host(App):
        def compose(self) -> ComposeResult:
            yield RingChart()

    async with Host().run_test() as pilot:
        chart = pilot.app.query_one(RingChart)
        assert str(chart.render()) == "no ring pass yet"
        chart.pass_name = "decode_lead"
        chart.steps = [RingStep(0, 0, 1.5, 0.0, 64), RingStep(0, 1, 0.0, 0.5, 0)]
        assert "step 0" in str(chart.render()) and "step 1" in str(chart.render())
        chart.pass_name, chart.steps = "decode_gather", []  # rank 0 decoded alone on a copy of the K/V
        assert str(chart.render()).startswith("last pass: decode_gather: rank 0 alone")


def test_answer_text_keeps_one_message_waiting_and_sends_the_rest_together():
    """Tokens faster than the screen shows them go in one message each time the screen catches up, in
    order, none lost; the end of a turn sends what is left before the turn's last message."""
    posted: list[TokensArrived] = []
    text = AnswerText(posted.append)
    text.add("a")
    text.add("b")
    text.add("c")
    assert [(m.text, m.count) for m in posted] == [("a", 1)]
    text.shown()
    assert [(m.text, m.count) for m in posted] == [("a", 1), ("bc", 2)]
    text.shown()  # nothing arrived meanwhile: the next token goes at once
    text.add("d")
    text.add("e")
    text.flush()
    text.flush()
    assert [(m.text, m.count) for m in posted[2:]] == [("d", 1), ("e", 1)]
