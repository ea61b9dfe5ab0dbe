"""Several conversations held on the ranks at once, by name: which one a prompt continues, which go
when the count or the byte budget is reached (cpchat.client.held), and through real ranks, three
conversations in turn, each continued from memory as mlx-lm answers it."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import DEMO_MODEL
from helpers import VARIANTS, assert_same, prefill_event, random_prompt, raw_session
from references import MlxReference, reference_generate

from cpchat.client.events import Token
from cpchat.client.held import Held, HeldConversations
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.kvstore import KVShard
from cpchat.rank.sequences import Sequence, why_not_keep
from cpchat.smallmodels import write_model

ANSWER = 5


def held(conversations: HeldConversations, tokens: list[int], rank_bytes: tuple[int, ...] = ()) -> Held:
    """Run a new conversation that ends holding `tokens`."""
    conversations.run(None)
    conversations.current.tokens, conversations.current.rank_bytes = tokens, rank_bytes
    return conversations.current


def test_a_prompt_continues_the_conversation_it_keeps_half_of():
    c = HeldConversations(limit=4)
    a = held(c, list(range(100)))
    b = held(c, [7] * 10 + list(range(1000, 1040)))
    assert c.continued(list(range(130))) == (a, 100)  # a later turn of a
    assert c.continued(list(range(60)) + [5000]) == (a, 60)  # a rewritten turn of a
    assert c.continued([7] * 10 + [9] * 30) == (None, 0)  # shares the first tokens only: a new one
    assert c.continued(b.tokens) == (b, len(b.tokens) - 1)  # asked again: the last token is read again
    b.keep_floor = 45  # sliding windows forgot what a cut before 45 needs
    assert c.continued(b.tokens[:44] + [1]) == (None, 0)
    one = HeldConversations(limit=1)  # a front end's single conversation keeps what it can
    only = held(one, list(range(100)))
    assert one.continued(list(range(10)) + [5000]) == (only, 10)
    assert only.name == "" and one.run(None) == [] and list(one.by_name) == [""]


def test_the_least_recently_used_go_past_the_limit_and_the_budget():
    c = HeldConversations(limit=3, budget=1000)
    a, b, d = (held(c, [i], (300, 200)) for i in range(3))
    c.run(a)  # a used again: b is now the least recently used
    assert c.run(None) == [b.name] and set(c.by_name) == {a.name, d.name, c.current.name}
    c.current.tokens, c.current.rank_bytes = [9], (500, 100)
    assert c.over_budget() == [d.name]  # rank 0 held 1100
    c.current.rank_bytes = (1200, 0)  # alone past the budget: it goes too, after the others
    assert c.over_budget() == [a.name, c.current.name] and not c.by_name
    assert c.current.tokens == []  # a request of its name starts it again
    assert HeldConversations(limit=3).over_budget() == []  # no budget: memory decides (make_room)


def test_the_memory_check_lets_go_of_any_but_the_one_continued():
    c = HeldConversations(limit=4)
    a, b = held(c, list(range(50))), held(c, list(range(100, 150)))
    c.run(a)
    assert c.least_recent(besides=c.continued(list(range(60)))[0]) is b
    assert c.least_recent(besides=c.continued(list(range(100, 170)))[0]) is a
    c.clear()
    assert c.least_recent(besides=None) is None and c.continued(list(range(60))) == (None, 0)


def test_a_rank_says_why_a_conversation_cannot_keep_so_many_tokens():
    seq = Sequence.empty(KVShard(2))
    seq.total_tokens, seq.keep_floor, seq.states.snapshots = 100, 30, {0: {}, 40: {}}
    assert why_not_keep(seq, 101, linear=False) == "the ring holds 100"
    assert why_not_keep(seq, 20, linear=False).startswith("sliding-window layers hold keys for 30 tokens on")
    assert why_not_keep(seq, 0, linear=False) is None and why_not_keep(seq, 50, linear=False) is None
    linear = "linear-attention layers hold their state after 0, 40, 100 tokens only"
    assert why_not_keep(seq, 50, linear=True) == linear
    assert why_not_keep(seq, 40, linear=True) is None and why_not_keep(seq, 100, linear=True) is None
    assert why_not_keep(None, 0, linear=True) is None  # a conversation not held
    assert why_not_keep(None, 3, linear=False) == "the ring holds 0"


def forms(tmp_path_factory, model_dir, form: str):
    """The model and K/V format of a form: a test architecture, a variant, or 4-bit K/V of the demo model."""
    if form == "kv4":
        return DEMO_MODEL, KVFormat(4, 32, 75)  # A holds 74: its next prompt reads quantized K/V
    if form in VARIANTS and form not in ("llama", "qwen3_next"):
        arch, options = VARIANTS[form]
        return write_model(tmp_path_factory.mktemp(form) / form, arch, **options), FULL_PRECISION
    return model_dir(form), FULL_PRECISION


@pytest.mark.parametrize("form, ranks", [("llama", 2), ("llama", 1), ("qwen3_next", 2),
                                         ("mistral-sliding", 2), ("kv4", 2)])
def test_conversations_in_turn_each_continue_from_memory_as_mlx_lm(clusters, model_dir, tmp_path_factory,
                                                                   form, ranks):
    """Three conversations, two turns each, asked in turn A B C A B C on one ring: each second turn
    prefills only its new tokens, from memory, and every answer is mlx-lm's over that conversation alone
    (a hybrid's linear states, sliding windows and 4-bit K/V parked and taken back with the rest)."""
    path, kv = forms(tmp_path_factory, model_dir, form)
    prompts = {c: [random_prompt(path, 70 + 13 * i, seed=40 + i), random_prompt(path, 9, seed=50 + i)]
               for i, c in enumerate("ABC")}
    reference = MlxReference(path, kv) if kv.quantized else None

    def expected(ids: list[int]):
        return reference(ids, ANSWER)[0] if reference else reference_generate(path, ids, ANSWER)

    try:
        turns = {}  # mlx-lm's, each conversation's turns in order
        for c, (first, second) in prompts.items():
            answer = expected(first)
            turns[c] = [(first, answer), (first + [t for t, _ in answer] + second, None)]
            turns[c][1] = (turns[c][1][0], expected(turns[c][1][0]))
    finally:
        if reference:
            reference.close()
    cluster = clusters.get(ranks, path, kv=kv)
    session = raw_session(cluster, path, "auto", ANSWER)
    session.conversations = HeldConversations(limit=3)
    for turn in (0, 1):
        for c in "ABC":
            ids, answer = turns[c][turn]
            events = list(session.generate(ids))
            assert_same([(e.id, e.logprob) for e in events if isinstance(e, Token)], answer)
            prefill = prefill_event(events)
            if turn:
                first, answer = turns[c][0]  # the answer's last token is read only after a stop token
                held_before = len(first) + len(answer) - (len(answer) == ANSWER)
                assert (prefill.cache, prefill.cached_tokens) == ("memory", held_before), c
            else:
                assert prefill.cached_tokens == 0
    stats = cluster.stats_once()
    assert all(s.sequences == 3 for s in stats)
    if form == "llama":
        assert sum(s.kv_tokens for s in stats) == session.conversations.tokens  # each token once


def test_a_cancel_that_reaches_one_rank_as_the_other_ends_leaves_them_agreeing(clusters, model_dir):
    """A cancel that comes as a request ends may find one rank still in it (it rolls back to the tokens
    kept) and the other done (it keeps the request's): the session brings both back to the tokens kept
    and counts what they hold. The race is made here by rolling one real rank back, as its abort does."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    session = raw_session(cluster, path, "auto", 2)
    list(session.generate(random_prompt(path, 41, seed=4)))
    held = session.conversations.current
    later = [*held.tokens, 7]  # a later turn, that keeps every token held
    keep = held.kept(later)
    list(session.generate(later))
    assert sum(s.kv_tokens for s in cluster.stats_once()) == len(held.tokens) > keep
    cluster.ranks[1].control.Reset(pb.ResetRequest(keep_tokens=keep, sequence=held.name),
                                   metadata=cluster.metadata)  # what rank 1's abort does
    results = cluster.last_results
    results[1] = dataclasses.replace(results[1], done=dataclasses.replace(results[1].done, cached_tokens=keep,
                                                                          cancelled=True))
    agreed = session._agreed(results[0].done, held.name, keep)
    assert agreed.cached_tokens == keep and agreed.cancelled
    assert sum(s.kv_tokens for s in cluster.stats_once()) == keep, "every rank holds the tokens kept"
    held.tokens = later[:keep]
    assert [e for e in session.generate(later) if isinstance(e, Token)], "and the next turn runs on"
