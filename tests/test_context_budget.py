"""The model's context is a budget: known before a prefill starts, refused past it unless the user
insists, answers cut at its end; and the prefill's estimate from what the ranks measured."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cpchat.client.session import ContextOverflow, SamplingOptions, Session, load_tokenizer
from cpchat.core import attention
from cpchat.core.estimate import PrefillCost, line_through, rank_pairs
from cpchat.core.sharding import head_tail_layout, head_tail_positions
from cpchat.format import human_duration
from cpchat.rank.fit import usable_context
from cpchat.rank.forward import probe_forward
from cpchat.rank.model_load import load_model
from cpchat.smallmodels import write_model

CONTEXT = 160
GROUPS = 3


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A llama whose config says it was made for 160 positions."""
    return write_model(tmp_path_factory.mktemp("short") / "llama", "llama", max_position_embeddings=CONTEXT)


def test_usable_context_reads_rope_scaling():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert usable_context({"max_position_embeddings": 40960, "rope_scaling": yarn}) == 131072  # Qwen3 + YaRN
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert usable_context({"max_position_embeddings": 131072, "rope_scaling": llama3}) == 131072
    linear = {"type": "linear", "factor": 2}
    assert usable_context({"max_position_embeddings": 4096, "rope_scaling": linear}) == 8192
    assert usable_context({"text_config": {"max_position_embeddings": 131072}}) == 131072  # gemma 3
    assert usable_context({"n_positions": 1024}) == 1024
    assert usable_context({}) == 0


def test_prefill_cost_grows_with_tokens_and_context_and_shrinks_with_ranks():
    cost = PrefillCost(fixed_s=0.01, per_token_s=1e-4, per_pair_s=1e-9, per_masked_pair_s=2e-9)
    # one rank, 1000 tokens: one tile, masked
    assert cost.seconds(1000, 0, 1) == pytest.approx(0.01 + 0.1 + 2e-9 * 1000 * 1000)
    # two ranks: 500 tokens each; rank 1's two chunks, [250, 500) and [500, 750), make one tile that
    # reads rank 0's head chunk whole and its own block masked, and skips rank 0's tail chunk
    assert cost.seconds(1000, 0, 2) == pytest.approx(0.01 + 0.05 + 1e-9 * 500 * 250 + 2e-9 * 500 * 500)
    assert cost.seconds(1000, 4000, 2) > cost.seconds(1000, 0, 2)
    assert cost.seconds(100_000, 0, 4) < cost.seconds(100_000, 0, 2) < cost.seconds(100_000, 0, 1)
    assert line_through(8, 0.5, 40, 1.3) == pytest.approx((0.3, 0.025))
    assert line_through(8, 0.5, 40, 0.4) == (0.5, 0.0), "noise never gives a negative cost"
    assert [human_duration(s) for s in (0.2, 42, 150, 4000)] == ["1 s", "42 s", "2 min", "1 h 7 min"]


@pytest.mark.parametrize("tokens, ranks, cached, shares", [
    (2048, 2, 0, None), (5000, 2, 0, None), (3001, 3, 0, None), (4096, 1, 0, None), (2500, 2, 700, None),
    (5000, 2, 0, (1, 3)), (3001, 3, 300, (3, 1, 2))])
def test_rank_pairs_count_what_the_tiles_compute(monkeypatch, tokens, ranks, cached, shares):
    """The estimate's pair counts against partial_attention's own tiles: every rank's queries over
    each rank's block of keys (as pass-KV runs them) and over the cached ones, in equal and unequal
    shares (whose chunks meet no tile boundary: no tile spans a head and a tail chunk)."""
    counted: list[list[int]] = []  # per call of _scores: [pairs, masked]
    scores, visible = attention._scores, attention._visible

    def counting(xp, qt, kt):
        counted.append([qt.shape[2] // GROUPS * kt.shape[-1], 0])  # pairs of each query head
        return scores(xp, qt, kt)

    monkeypatch.setattr(attention, "_scores", counting)

    def masking(xp, q_pos, k_pos, window):
        counted[-1][1] = 1
        return visible(xp, q_pos, k_pos, window)

    monkeypatch.setattr(attention, "_visible", masking)
    each = []
    for rank in range(ranks):
        q_pos = cached + np.array(head_tail_layout(tokens, ranks, rank, shares).positions())
        blocks = [cached + np.array(head_tail_positions(tokens, ranks, r, shares)) for r in range(ranks)]
        if cached:
            blocks.append(np.arange(cached))
        counted.clear()
        for k_pos in blocks:
            q = mx.zeros((1, GROUPS, len(q_pos), 4))  # one key head, GROUPS query heads
            kv = mx.zeros((1, 1, len(k_pos), 4))
            attention.partial_attention(q, kv, kv, q_pos, k_pos, scale=1.0)
        each.append((sum(n for n, m in counted if not m), sum(n for n, m in counted if m)))
    assert each == rank_pairs(tokens, cached, ranks, GROUPS, shares)


def test_a_calibration_forward_longer_than_the_vocabulary_feeds_only_its_tokens(model_dir):
    """The calibration runs forwards of up to 1024 tokens; these models' vocabulary has 512. MLX's
    gather reads past the embedding for an id outside it, and a rank crashed loading a model."""
    model, info = load_model(str(model_dir("llama")))
    embed, seen = model.model.embed_tokens, []

    def recording(ids: mx.array) -> mx.array:
        seen.append(int(ids.max()))
        return embed(ids)

    model.model.embed_tokens = recording
    probe_forward(model, info.vocab_size, chunk=info.vocab_size)
    assert seen == [info.vocab_size - 1]

def session_on(clusters, model, max_tokens: int = 200) -> Session:
    cluster = clusters.get(2, model)
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    return Session(cluster, load_tokenizer(str(model)), raw=True, sampling=sampling)


def test_the_ranks_report_the_context_and_a_measured_prefill_cost(clusters, short_model):
    session = session_on(clusters, short_model)
    assert session.context_limit == CONTEXT
    cost = session.cluster.prefill_cost
    assert cost.per_token_s > 0 and cost.per_pair_s > 0
    short, long = session.prepare("one two three"), session.prepare("word " * 100)
    assert 0 < session.prefill_estimate_s(short) < session.prefill_estimate_s(long)


def test_a_prompt_past_the_context_is_refused_unless_the_user_insists(clusters, short_model):
    session = session_on(clusters, short_model, max_tokens=4)
    turn = session.prepare("word " * 200)
    assert len(turn.tokens) >= CONTEXT
    with pytest.raises(ContextOverflow) as e:
        list(session.run(turn))
    assert (e.value.prompt_tokens, e.value.limit) == (len(turn.tokens), CONTEXT)
    assert f"{len(turn.tokens):,} tokens" in str(e.value) and f"{CONTEXT:,}-token context" in str(e.value)
    assert session.messages == [] and session.held.tokens == []
    done = list(session.run(turn, past_context=True))[-1]
    assert done.prompt_tokens == len(turn.tokens) and done.generated_tokens == 4
    assert sum(r.kv_tokens for r in done.ranks) == len(turn.tokens) + 3, "the refused turn left nothing"


def test_an_answer_stops_at_the_end_of_the_context(clusters, short_model):
    session = session_on(clusters, short_model, max_tokens=200)
    turn = session.prepare("word " * 40)
    assert CONTEXT - 60 < len(turn.tokens) < CONTEXT - 10
    done = list(session.run(turn))[-1]
    assert done.generated_tokens == CONTEXT - len(turn.tokens), "cut at the context's end, not at max_tokens"
    assert done.prompt_tokens + done.generated_tokens <= CONTEXT
