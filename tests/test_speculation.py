"""Speculative decoding (--speculate lookup): each decode step checks the last token and tokens proposed
from the conversation itself as one causal block on every rank, and keeps those the model samples. The
answers are mlx-lm's own generation without speculation: greedy tokens identical and logprobs within
1e-3 (float32), for N = 1..4, every decode step, quantized K/V, a hybrid and a sliding-window model;
sampled answers are those of one token a step, seed for seed."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import DEMO_MODEL
from helpers import (
    VARIANTS,
    assert_same,
    done_event,
    next_turn,
    question_ids,
    random_prompt,
    rank_holds,
    raw_session,
)
from mlx_lm.models.cache import can_trim_prompt_cache
from references import MlxReference, reference_generate, reference_tokenizer

from cpchat.client.cluster import Cluster
from cpchat.client.events import Token
from cpchat.core.lookup import MAX_DRAFT, DraftLength, propose
from cpchat.core.quantized_kv import KVFormat
from cpchat.core.stages import Stages
from cpchat.errors import BadInput
from cpchat.rank.draft import DraftModel, DraftModelError
from cpchat.rank.prefix_cache import PrefixStore
from cpchat.rank.prefix_keeper import PrefixKeeper
from cpchat.smallmodels import write_model

MAX_TOKENS = 24


def test_proposals_follow_the_longest_earlier_match_and_its_most_common_continuation():
    t = np.array
    # "7 8" occurred twice before, each time followed by something else: the latest wins the tie
    assert propose(t([7, 8, 1, 2, 7, 8, 4, 5, 6, 9, 7, 8]), 3).tolist() == [4, 5, 6]
    # the longest match wins over a later, shorter one: "3 7 8" is followed by 1
    assert propose(t([3, 7, 8, 1, 2, 7, 8, 4, 5, 3, 7, 8]), 2).tolist() == [1, 2]
    # "5 1" came three times, followed by 9, 9 and 4: the most common continuation, its latest occurrence
    assert propose(t([5, 1, 9, 5, 1, 9, 5, 1, 4, 5, 1]), 1).tolist() == [9]
    # a match near the end goes on as the repeat it is (an overlapping copy)
    assert propose(t([5, 6, 9, 5, 6]), 7).tolist() == [9, 5, 6, 9, 5, 6, 9]
    assert propose(t([1, 2, 3, 9, 3]), 4).tolist() == [9, 3, 9, 3]
    # nothing occurred before, or no room
    assert propose(t([1, 2, 3, 4]), 4).tolist() == [] and propose(t([1]), 4).tolist() == []
    assert propose(t([1, 2, 1]), 0).tolist() == []


def test_the_draft_length_follows_what_holds_and_what_a_step_costs():
    d = DraftLength()
    assert d.next() == 0  # a = 1/4 and a quarter step a token: (1 + a) / 1.25 = 1, no better than none
    d.score(1, 1)  # a proposal not sent would have held: a = 1.4 / 2.6
    assert d.next() == 1
    d.record(0, 0, seconds=0.1)  # a plain step
    d.record(1, 1, seconds=0.105)  # one proposal checked, and held: 5 % a token, measured
    assert d.cost == pytest.approx(0.05)
    assert d.next() == 4  # a = 2.12 / 3.08 would take 5, but one held: at most 2 x 1 + 2
    for _ in range(3):
        d.record(d.next(), d.next())  # every proposal held
    assert d.next() == MAX_DRAFT
    for _ in range(15):
        d.score(1, 0)  # and then none: one in twenty would hold, not worth 5 % a token
    assert d.next() == 0
    d.record(4, 0, seconds=0.14)  # four proposals checked: 10 % a token
    assert d.cost == pytest.approx(0.8 * 0.05 + 0.2 * 0.1)
    assert d.proposed - d.accepted == 4  # the totals: a score of a proposal not sent is not in them
    d.record(2, 0, seconds=0.1)  # checked as fast as a plain step: still a cost, if a small one
    assert d.cost == pytest.approx(0.8 * 0.06 + 0.2 * DraftLength.MIN_COST)
    assert DraftLength(fixed=5).next() == 5


def test_the_cost_of_a_proposal_is_estimated_from_the_first_plain_step():
    """Before any check, what a proposed token adds to a step (by the rank's measured forward cost) over
    a plain step's time; then the checks' own times."""
    d = DraftLength(query_s=0.004)
    assert d.next() == 0  # no plain step timed yet: a quarter step a token
    d.record(0, 0, seconds=0.1)
    assert d.cost == pytest.approx(0.04)
    assert d.next() == 2  # at 4 % a token even a = 1/4 pays: (1 + a + a^2) / 1.08 beats (1 + a) / 1.04
    d.record(0, 0, seconds=0.1)
    assert d.cost == pytest.approx(0.04)  # a mean of plain steps, 0.1 s
    d.record(1, 0, seconds=0.11)  # a check measured: 10 % a token
    assert d.cost == pytest.approx(0.1)
    d.record(0, 0, seconds=0.05)
    assert d.cost == pytest.approx(0.1)  # measured: the estimate no longer counts
    assert DraftLength(query_s=1e-6).cost == 0.25 and DraftLength(query_s=1e-6).next() == 0
    d = DraftLength(query_s=1e-6)
    d.record(0, 0, seconds=0.1)
    assert d.cost == DraftLength.MIN_COST  # never below what one step's noise allows


def answer(cluster, path, ids, decode="auto", draft_tokens=0, max_tokens=MAX_TOKENS, speculate="lookup",
           temperature=0.0, seed=0):
    session = raw_session(cluster, path, "auto", max_tokens)
    session.speculate, session.draft_tokens = speculate, draft_tokens
    session.planner.decode = decode
    session.sampling.temperature, session.sampling.seed = temperature, seed
    got, events = next_turn(session, ids)
    return got, done_event(events)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_quoting_answers_accept_proposals_and_stay_mlx_lm_s(clusters, ranks):
    """The demo model answers a question about its document by quoting it: four proposals a step, some
    accepted, several tokens a step, some rejected where the document put the fact in other words; the
    answer's end-of-sequence token comes inside a block; every decode step of N ranks gives mlx-lm's
    answer, with four proposals a step and with as many as pay (which follows the machine's timings)."""
    ids, _ = question_ids(DEMO_MODEL, seed=3)
    expected = reference_generate(DEMO_MODEL, ids, MAX_TOKENS)
    assert len(expected) < MAX_TOKENS and expected[-1][0] in reference_tokenizer(DEMO_MODEL).eos_token_ids
    expected = expected[:-1]  # cpchat does not emit the end-of-sequence token
    cluster = clusters.get(ranks, DEMO_MODEL)
    for decode in ("exchange", "ring", "lead", "gather") if ranks > 1 else ("exchange",):
        cluster.reset(0)
        got, done = answer(cluster, DEMO_MODEL, ids, decode, draft_tokens=4)
        speculated = done.speculation
        assert_same(got, expected)
        assert speculated.mode == "lookup"
        assert speculated.proposed > speculated.accepted > 0, (decode, speculated)
        assert speculated.steps < len(got) - 1  # more than one token a step
        assert {s.algorithm for s in cluster.stats_once()} <= {f"decode_{decode}"}
        cluster.reset(0)
        assert_same(answer(cluster, DEMO_MODEL, ids, decode)[0], expected)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_shards_keep_only_the_answer(clusters, model_dir, ranks):
    """A random model's answer to a prompt that repeats itself, eight tokens proposed a step: mlx-lm's
    answer, and the shards hold the prompt and the answer but its last token, whatever was proposed;
    likewise for an answer that max tokens cuts inside a block."""
    path = model_dir("llama")
    phrase = random_prompt(path, 12, seed=5)
    ids = phrase + random_prompt(path, 5, seed=6) + phrase[:4]
    expected = reference_generate(path, ids, MAX_TOKENS)
    cluster = clusters.get(ranks, path)
    for decode in ("exchange", "gather") if ranks > 1 else ("exchange",):
        cluster.reset(0)
        got, done = answer(cluster, path, ids, decode, draft_tokens=8)
        assert_same(got, expected)
        assert done.speculation.proposed >= 8, done.speculation
        assert sum(r.kv_tokens for r in done.ranks) == len(ids) + MAX_TOKENS - 1  # no rejected token kept
        cluster.reset(0)
        got, done = answer(cluster, path, ids, decode, draft_tokens=8, max_tokens=6)
        assert_same(got, expected[:6])
        assert sum(r.kv_tokens for r in done.ranks) == len(ids) + 5


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_from_inside_the_answer(clusters, bits):
    """--kv-bits with the K/V turning quantized three tokens into the answer: no block spans that
    point (mlx-lm quantizes before a step), and the answer is mlx-lm's with the same kv_bits."""
    ids, _ = question_ids(DEMO_MODEL, seed=3)
    kv = KVFormat(bits, 32, len(ids) + 3)
    reference = MlxReference(DEMO_MODEL, kv)
    try:
        expected, _ = reference(ids, MAX_TOKENS)
    finally:
        reference.close()
    expected = [p for p in expected if p[0] not in reference_tokenizer(DEMO_MODEL).eos_token_ids]
    for ranks in (1, 2):
        got, done = answer(clusters.get(ranks, DEMO_MODEL, kv=kv), DEMO_MODEL, ids, draft_tokens=4)
        assert_same(got, expected)
        assert done.speculation.accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant, ranks, stages, seed", [("qwen3_next", 2, 1, 13), ("nemotron_h", 3, 1, 1),
                                                          ("mistral-sliding", 2, 1, 5), ("llama", 4, 2, 1)])
def test_hybrids_windows_and_stages(clusters, model_dir, tmp_path_factory, variant, ranks, stages, seed):
    """Linear layers (their states restored from before a block and the kept tokens run again), sliding
    windows of 8 (blocks that reach past a window), and two pipeline stages of two context ranks: a
    prompt, then the same prompt again, whose answer repeats much of the first (a random model follows
    its last tokens; the seeds are prompts where it does): mlx-lm's answers, proposals made and kept."""
    arch, options = VARIANTS[variant]
    path = model_dir(arch) if not options else write_model(tmp_path_factory.mktemp(variant) / arch, arch,
                                                           **options)
    cluster = clusters.get(ranks, path, stages=Stages(stages))
    cluster.reset(0)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    session.speculate, session.draft_tokens = "lookup", 4
    history: list[int] = []
    proposed = accepted = 0
    phrase = random_prompt(path, 10, seed=seed)
    for new in (phrase, phrase):
        got, events = next_turn(session, new)
        history += new
        assert_same(got, reference_generate(path, history, MAX_TOKENS))
        history += [t for t, _ in got]
        proposed += done_event(events).speculation.proposed
        accepted += done_event(events).speculation.accepted
    assert accepted > 0 and proposed > 0


@pytest.mark.parametrize("ranks, stages", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_a_draft_model_proposes_and_the_answer_stays_mlx_lm_s(clusters, model_dir, tmp_path_factory, ranks,
                                                             stages):
    """--speculate draft:MODEL, three proposals a step from the sampling rank: the model as its own draft
    (every proposal kept), another seed of it (most rejected) and a hybrid of the same tokenizer (its
    states cannot be cut back: read again after a rejection). For every decode step of N ranks (and two
    stages of two) and each draft, over two turns (the draft follows the conversation) and after the
    ring is cut back to nothing: mlx-lm's answers."""
    path = model_dir("llama")
    drafts = {"itself": path, "another seed": write_model(tmp_path_factory.mktemp("draft") / "llama", "llama",
                                                          seed=7),
              "a hybrid": model_dir("qwen3_next")}
    phrase = random_prompt(path, 10, seed=5)
    first = reference_generate(path, phrase, MAX_TOKENS)
    history = phrase + [t for t, _ in first] + phrase[:4]
    second = reference_generate(path, history, MAX_TOKENS)
    cluster = clusters.get(ranks, path, stages=Stages(stages))
    for decode in ("exchange", "gather") if ranks > stages else ("exchange",):
        for name, draft in drafts.items():
            cluster.reset(0)
            session = raw_session(cluster, path, "auto", MAX_TOKENS)
            session.speculate, session.planner.decode = f"draft:{draft}", decode
            counts = []
            for new, expected in ((phrase, first), (phrase[:4], second)):
                got, events = next_turn(session, new)
                assert_same(got, expected)
                counts.append(done_event(events).speculation)
            assert all(c.mode == "draft" and c.proposed >= 3 for c in counts), (name, counts)
            if name == "itself":
                assert all(c.accepted == c.proposed and c.steps <= MAX_TOKENS // 3 for c in counts), counts
            elif name == "another seed":
                assert all(c.accepted < c.proposed for c in counts), counts


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_draft_model_follows_the_conversation_as_it_grows_and_is_cut_back(model_dir, arch):
    """The draft proposes mlx-lm's own greedy continuation of whatever it is handed, whether the tokens
    extend what it read, part from it after its own proposals (a rejection) or are cut back to a few
    (the ring reset): a cache cut back too little, too much or not at all proposes other tokens. A
    hybrid's states cannot be cut back: it reads the conversation again."""
    path = model_dir(arch)
    draft = DraftModel(str(path))
    phrase = np.array(random_prompt(path, 12, seed=5), np.uint32)
    proposed = draft.propose(phrase, 3)
    rejected = np.append(phrase, [proposed[0], (proposed[1] + 1) % 400 + 3]).astype(np.uint32)
    for tokens in (phrase, np.append(phrase, proposed).astype(np.uint32), rejected, phrase[:5], phrase):
        expected = [t for t, _ in reference_generate(path, tokens.tolist(), 3)]
        assert draft.propose(tokens, 3)[:len(expected)] == expected


@pytest.mark.parametrize("form", ["llama", "qwen3_next", "mistral-sliding", "bfloat16"])
def test_a_draft_model_s_state_is_saved_with_the_prefix_and_taken_back(model_dir, checkpoint, tmp_path, form):
    """What the draft read of a conversation is saved beside the ring's prefix, cut to the ring's
    tokens, and a new draft (a rank started again, or one that followed another conversation) takes
    it back from disk and reads only the new tokens, proposing mlx-lm's own continuation. A state that
    cannot be cut back (a hybrid's, a window of 8 that wrapped) is saved and taken only whole; a file
    that can be cut anywhere is superseded by the next save of its conversation."""
    if form in VARIANTS:
        arch, options = VARIANTS[form]
        path = write_model(tmp_path / form, arch, **options)
    else:
        path = checkpoint(form) if form == "bfloat16" else model_dir(form)
    keeper = PrefixKeeper()
    keeper.cache = PrefixStore(tmp_path / "prefix", 1 << 30)
    doc = np.array(random_prompt(path, 40, seed=5), np.uint32)
    draft = DraftModel(str(path))
    proposed = draft.propose(doc, 3)  # it read the document and two of its proposals
    whole = not can_trim_prompt_cache(draft.cache)
    taken = 2 if whole else 1  # the ring kept one proposal (or two: all the draft read)
    keeper.tokens = np.append(doc, proposed[:taken]).astype(np.uint32)
    draft.save(keeper)
    keeper.flush()
    [saved] = keeper.cache.entries(draft.identity)
    assert saved.header["tokens"] == len(doc) + taken and bool(saved.header["state_positions"]) == whole
    question = np.append(keeper.tokens, random_prompt(path, 6, seed=6)).astype(np.uint32)
    again = DraftModel(str(path))
    if whole:  # a conversation that parts from the saved one within it cannot take it
        again.resume(keeper, np.append(doc, [proposed[0], (proposed[1] + 1) % 400 + 3]).astype(np.uint32))
        assert len(again.read) == 0
    again.resume(keeper, question)
    held, read = len(again.read), []
    assert held == len(doc) + taken
    model = again.model
    again.model = lambda x, cache: read.append(x.shape[1]) or model(x, cache=cache)
    expected = [t for t, _ in reference_generate(path, question.tolist(), 3)]
    proposed = again.propose(question, 3)
    assert proposed[:len(expected)] == expected
    assert read[0] + read[1] == len(question) - held  # the new tokens, then the last one's logits
    keeper.tokens = np.append(question, proposed[:taken]).astype(np.uint32)
    again.save(keeper)
    keeper.flush()
    files = sorted(e.header["tokens"] for e in keeper.cache.entries(again.identity))
    assert files == [len(doc) + taken] * whole + [len(keeper.tokens)]


def test_a_draft_model_the_rank_cannot_load_is_refused_by_name(clusters, model_dir):
    """A draft model that is not on the sampling rank's disk: one error naming it, and the ring answers
    the next turn exactly."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    cluster.reset(0)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    session.speculate = "draft:/nowhere/draft-model"
    phrase = random_prompt(path, 10, seed=5)
    with pytest.raises(BadInput, match="draft model /nowhere/draft-model"):
        next_turn(session, phrase)
    session.speculate = "lookup"
    assert_same(next_turn(session, phrase)[0], reference_generate(path, phrase, MAX_TOKENS))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_draft_model_counts_what_it_would_hold(model_dir, arch):
    """Its weights are refused before they are read where they take more than the rank may hold, and a
    conversation whose K/V it could not hold is refused by name; what a token adds is its K and V in
    every attention layer (a hybrid's linear layers keep a state of one size)."""
    path = model_dir(arch)
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(DraftModelError, match=rf"draft model {re.escape(str(path))}: its weights take "):
        DraftModel(str(path), free=1000)
    draft = DraftModel(str(path))
    heads, dim = config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // \
        config["num_attention_heads"]
    attention = config["num_hidden_layers"] // config.get("full_attention_interval", 1)
    assert draft.token_bytes == attention * 2 * heads * dim * 4  # float32 K and V
    draft.check_room(100, 100 * draft.token_bytes)
    with pytest.raises(DraftModelError, match=r"its K/V of 101 tokens take .* but this rank may hold"):
        draft.check_room(101, 100 * draft.token_bytes)
    draft.propose(np.arange(3, 53, dtype=np.uint32), 1)  # 50 tokens read: only the rest is counted
    draft.check_room(150, 100 * draft.token_bytes)


@pytest.mark.slow
def test_a_draft_model_the_rank_cannot_hold_is_refused_by_name(tmp_path, model_dir, monkeypatch):
    """A rank whose memory holds the model but not its draft's weights: one line naming the draft, before
    any of it is read, and the rank goes on answering without it."""
    path = model_dir("llama")
    draft = write_model(tmp_path / "wide", "llama", num_layers=4, hidden_size=1024, num_heads=16)
    weights = sum(f.stat().st_size for f in draft.glob("*.safetensors"))
    monkeypatch.setenv("CPCHAT_MEMORY_LIMIT", str(4 * weights))  # (rank_holds measures under it)
    monkeypatch.setenv("CPCHAT_MEMORY_LIMIT", str(rank_holds(4 * weights, path) + weights // 4))
    cluster = Cluster.launch(1)
    try:
        cluster.connect()
        cluster.load(str(path))
        session = raw_session(cluster, path, "auto", MAX_TOKENS)
        session.speculate = f"draft:{draft}"
        phrase = random_prompt(path, 10, seed=5)
        refusal = rf"draft model {re.escape(str(draft))}: its weights take [\d.]+ MiB but this rank may hold"
        with pytest.raises(BadInput, match=refusal):
            next_turn(session, phrase)
        assert cluster.stats_once()[0].mlx_peak_bytes < weights // 4  # none of it read
        session.speculate = "lookup"
        assert_same(next_turn(session, phrase)[0], reference_generate(path, phrase, MAX_TOKENS))
    finally:
        cluster.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_sampled_answers_are_those_of_one_token_a_step(clusters, ranks):
    """At temperature 0.8 each answer position draws from its own seed, as without proposals, and a
    proposal stays only where the model's draw equals it: for each seed the answer is the one sampled
    a token a step (a rule that kept a likely proposal the model did not draw, or drew again after a
    rejection, gives other answers for some seeds), and the seeds give different answers. The prompt
    is random tokens and their first eight again: the demo model copies on, not always alike."""
    phrase = random_prompt(DEMO_MODEL, 40, seed=8)
    ids = phrase + phrase[:8]
    cluster = clusters.get(ranks, DEMO_MODEL)
    answers, accepted = set(), {}
    for seed in range(12):
        kw = {"temperature": 0.8, "seed": seed, "draft_tokens": 4}
        plain, _ = answer(cluster, DEMO_MODEL, ids, speculate="off", **kw)
        for speculate in ("lookup", f"draft:{DEMO_MODEL}"):
            got, done = answer(cluster, DEMO_MODEL, ids, speculate=speculate, **kw)
            assert_same(got, plain)
            accepted[speculate] = accepted.get(speculate, 0) + done.speculation.accepted
        answers.add(tuple(t for t, _ in plain))
    assert len(answers) >= 3 and all(accepted.values()), accepted


def test_a_cancelled_answer_leaves_the_ring_exact(clusters, model_dir):
    """Esc during an answer of blocks: the answer stops, and the next turn is mlx-lm's answer to the
    conversation as the ring holds it."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    cluster.reset(0)
    session = raw_session(cluster, path, "auto", 4000)
    session.speculate, session.draft_tokens = "lookup", 8
    phrase = random_prompt(path, 10, seed=28)
    tokens = 0
    for event in session.generate(phrase):
        if isinstance(event, Token):
            tokens += 1
            if tokens == 1:
                session.cancel()
    assert 1 <= tokens < 4000 and session.held.tokens == []  # the cancelled turn is dropped whole
    before, new = list(session.raw_history), random_prompt(path, 7, seed=29)
    session.sampling.max_tokens = MAX_TOKENS
    got, _ = next_turn(session, new)
    assert_same(got, reference_generate(path, before + new, MAX_TOKENS))
