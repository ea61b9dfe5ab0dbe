"""Context-parallel generation through real rank processes equals mlx-lm's
single-process greedy generation: same tokens, logprobs within 1e-3."""

import os

import pytest
from helpers import (
    ALGORITHMS,
    assert_same,
    done_event,
    next_turn,
    prefill_event,
    random_prompt,
    raw_session,
    run_raw,
)
from references import reference_generate, reference_top_logprobs

from cpchat.client.generation import GenerationRequest, TokenOut
from cpchat.core.memory import kv_bytes_per_token

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MAX_TOKENS = 8





@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_short_prompts_all_algorithms(clusters, model_dir, arch, ranks):
    path = model_dir(arch)
    cluster = clusters.get(ranks, path)
    for length in (1, 5, 2 * ranks * 3 + 1):
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, MAX_TOKENS)
        for algorithm in ALGORITHMS:
            cluster.reset(0)
            got, events, session = run_raw(cluster, path, ids, algorithm, MAX_TOKENS)
            assert_same(got, expected)
            used = prefill_event(events).algorithm
            assert used == (session.last_choice.algorithm if algorithm == "auto" else algorithm)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["pass_kv", "pass_q", "all_gather", "ulysses"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_two_thousand_token_prompt(clusters, model_dir, arch, ranks, algorithm):
    path = model_dir(arch)
    cluster = clusters.get(ranks, path)
    ids = random_prompt(path, 2001, seed=7)
    got, events, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS)
    assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    done = done_event(events)
    held = [r.kv_tokens for r in done.ranks]
    total = len(ids) + MAX_TOKENS - 1
    assert sum(held) == total
    assert max(held) - min(held) <= -(-len(ids) // (2 * ranks)) + 1


def test_local_ranks_send_through_shared_memory(clusters, model_dir):
    cluster = clusters.get(3, model_dir("llama"))
    assert cluster.link_transports == [["", "shm", "shm"], ["shm", "", "shm"], ["shm", "shm", ""]]
    # Three ranks computing on the CPU leave a core to move tensors only on a host of four or more.
    assert cluster.spare_cores == (len(os.sched_getaffinity(0)) > 3)
    assert cluster.one_machine
    address, links = cluster.ranks[2].address, cluster.link_transports
    cluster.ranks[2].address = "10.0.0.7:5000"  # as a rank on another host: its own address, over gRPC
    cluster.link_transports = [["", "shm", "grpc"], ["shm", "", "grpc"], ["grpc", "grpc", ""]]
    try:
        assert not cluster.one_machine
    finally:
        cluster.ranks[2].address, cluster.link_transports = address, links


@pytest.mark.slow
def test_every_algorithm_over_grpc_alone(clusters, model_dir):
    """The gRPC data plane (what ranks on other hosts use) gives the same answers."""
    path = model_dir("qwen3")
    cluster = clusters.get(3, path, transport="grpc")
    assert cluster.transport_label == "grpc"
    for length in (1, 2001):
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, MAX_TOKENS)
        for algorithm in ALGORITHMS:
            cluster.reset(0)
            assert_same(run_raw(cluster, path, ids, algorithm, MAX_TOKENS)[0], expected)


@pytest.mark.parametrize("ranks", [2, 3])
def test_kv_stays_balanced_through_decode(clusters, model_dir, ranks):
    path = model_dir("llama")
    cluster = clusters.get(ranks, path)
    ids = random_prompt(path, 301, seed=11)
    bound = -(-len(ids) // (2 * ranks))
    _, events, _ = run_raw(cluster, path, ids, "pass_kv", 1)
    held = [r.kv_tokens for r in done_event(events).ranks]
    assert sum(held) == len(ids)
    assert all(abs(h - len(ids) / ranks) <= bound for h in held)
    cluster.reset(0)
    _, events, _ = run_raw(cluster, path, ids, "pass_kv", 101)
    done = done_event(events)
    held = [r.kv_tokens for r in done.ranks]
    # The last token is fed back only when generation stopped at an end-of-turn token.
    assert sum(held) == len(ids) + done.generated_tokens - (done.generated_tokens == 101)
    assert all(abs(h - sum(held) / ranks) <= bound + 1 for h in held)


@pytest.mark.parametrize("algorithm", ["pass_kv", "pass_q", "auto"])
def test_follow_up_turns_prefill_only_new_tokens(clusters, model_dir, algorithm):
    """Three raw turns on one cluster equal one single-process run over the whole history."""
    path = model_dir("qwen3")
    cluster = clusters.get(3, path)
    session = raw_session(cluster, path, algorithm, 6)
    history: list[int] = []
    for turn, length in enumerate((200, 37, 5)):
        new = random_prompt(path, length, seed=100 + turn)
        tokens, events = next_turn(session, new)
        history += new
        assert_same(tokens, reference_generate(path, history, 6))
        prefill = prefill_event(events)
        assert prefill.cached_tokens == (0 if turn == 0 else len(history) - length - 1)
        history += [t for t, _ in tokens]


def test_a_turn_that_rewrites_history_keeps_the_common_prefix(clusters, model_dir):
    """An edited conversation keeps whatever prefix the ranks hold in common with it (here ending inside
    the first prompt), drops the rest, and equals one single-process run."""
    path = model_dir("qwen3")
    cluster = clusters.get(3, path)
    session = raw_session(cluster, path, "auto", 6)
    first = random_prompt(path, 60, seed=7)
    next_turn(session, first)
    edited = first[:23] + random_prompt(path, 9, seed=8)
    events = list(session.generate(edited))
    assert prefill_event(events).cached_tokens == 23
    got = [(e.id, e.logprob) for e in events if hasattr(e, "logprob")]
    assert_same(got, reference_generate(path, edited, 6))


@pytest.mark.parametrize("ranks", [3, 4])
def test_turns_mix_every_algorithm(clusters, model_dir, ranks):
    """A pass-KV first turn, an all-gather second, a Ulysses third and a pass-Q fourth share one
    sharded cache and equal one single-process run over the whole history."""
    path = model_dir("qwen2")
    cluster = clusters.get(ranks, path)
    session = raw_session(cluster, path, "pass_kv", 6)
    history: list[int] = []
    for turn, (algorithm, length) in enumerate(zip(ALGORITHMS[:4], (300, 41, 90, 1), strict=True)):
        session.planner.algorithm = algorithm
        new = random_prompt(path, length, seed=200 + turn)
        tokens, events = next_turn(session, new)
        history += new
        assert_same(tokens, reference_generate(path, history, 6))
        assert prefill_event(events).algorithm == algorithm
        history += [t for t, _ in tokens]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_decode_step_gives_mlx_lms_tokens(clusters, model_dir, ranks):
    """Every way of running a decode step gives mlx-lm's tokens, and the stats name the one that ran:
    the ring takes N-1 hops a layer where the exchange takes one, in a lead step rank 0 sends a
    query and takes partials back (two steps) while the others take a query and answer (one), and in a
    gather step nothing crosses per layer (rank 0 decodes over every rank's K/V, sent to it once)."""
    path = model_dir("mistral")
    cluster = clusters.get(ranks, path)
    ids = random_prompt(path, 123, seed=5)
    expected = reference_generate(path, ids, MAX_TOKENS)
    held = []
    steps_of = {"ring": [ranks] * ranks, "exchange": [2] * ranks, "lead": [2] + [1] * (ranks - 1),
                "gather": [0] * ranks}
    for decode, steps in steps_of.items():
        cluster.reset(0)
        session = raw_session(cluster, path, "pass_kv", MAX_TOKENS)
        session.planner.decode = decode
        tokens, events = next_turn(session, ids)
        assert_same(tokens, expected)
        stats = cluster.stats_once()
        assert {s.algorithm for s in stats} == {f"decode_{decode}"}
        assert [len({t.step for t in s.ring_steps}) for s in stats] == steps
        held.append([r.kv_tokens for r in done_event(events).ranks])
    assert all(h == held[0] for h in held)  # new tokens' K/V kept round the ranks, however the step ran
    cluster.reset(0)
    session = raw_session(cluster, path, "pass_kv", MAX_TOKENS)  # decode "auto": the cost model's pick
    planner = session.planner
    assert planner.decode_exchange(len(ids)) == "gather"  # every rank of this cluster shares this machine
    per_token = kv_bytes_per_token(planner.workload(1, len(ids)))
    too_long = cluster.free_memory()[0] // int(per_token)  # an answer whose copy rank 0 could not hold
    assert planner.decode_exchange(len(ids), too_long) == "lead"
    assert_same(next_turn(session, ids)[0], expected)
    assert {s.algorithm for s in cluster.stats_once()} == {f"decode_{planner.decode_exchange(len(ids))}"}


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stop_token_mid_answer_leaves_the_ranks_holding_what_they_read(clusters, model_dir, ranks):
    """A stop token ends the answer where mlx-lm's would, and the ranks hold the prompt and the tokens
    before it, not the step a rank alone builds ahead from the stop token before it knows it is one;
    so the next turn is exact."""
    path = model_dir("llama")
    cluster = clusters.get(ranks, path)
    ids = random_prompt(path, 40, seed=11)
    tokens = [t for t, _ in reference_generate(path, ids, MAX_TOKENS)]
    cut = next(i for i in range(2, MAX_TOKENS) if tokens[i] not in tokens[:i])  # first seen mid-answer
    events = list(cluster.generate(GenerationRequest(ids, max_tokens=MAX_TOKENS, stop_tokens=[tokens[cut]])))
    assert [e.id for e in events if isinstance(e, TokenOut)] == tokens[:cut]
    held = len(ids) + cut
    assert events[-1].done.cached_tokens == held
    if ranks == 1:
        assert events[-1].done.kv_tokens == held
    more = random_prompt(path, 5, seed=12)
    events = list(cluster.generate(GenerationRequest(more, keep_tokens=held, max_tokens=MAX_TOKENS)))
    assert_same([(e.id, e.logprob) for e in events if isinstance(e, TokenOut)],
                reference_generate(path, ids + tokens[:cut] + more, MAX_TOKENS))


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_most_likely_tokens_are_mlx_lms(clusters, model_dir, ranks):
    """Asked for alternatives (the server's top_logprobs), each step names mlx-lm's five most likely
    tokens with their logprobs, whether a rank alone decodes ahead or the ranks agree on each token."""
    path = model_dir("llama")
    ids = random_prompt(path, 30, seed=13)
    events = list(clusters.get(ranks, path).generate(GenerationRequest(ids, max_tokens=MAX_TOKENS,
                                                                       top_logprobs=5)))
    got = [e for e in events if isinstance(e, TokenOut)]
    assert [e.id for e in got] == [t for t, _ in reference_generate(path, ids, MAX_TOKENS)]
    for event, best in zip(got, reference_top_logprobs(path, ids, MAX_TOKENS, 5), strict=True):
        assert [i for i, _ in event.top] == [i for i, _ in best]
        assert [lp for _, lp in event.top] == pytest.approx([lp for _, lp in best], abs=1e-3)
