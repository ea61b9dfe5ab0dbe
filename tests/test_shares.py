"""Unequal shares (--shares, issue #42) through real ranks: each rank's head and tail chunks sized by
its share, every prefill algorithm and decode step still mlx-lm's answer, with lengths that no
share divides; the K/V each rank holds follows its share; auto shares follow measured speeds."""

import pytest
from helpers import (
    done_event,
    next_turn,
    prefill_event,
    random_prompt,
    raw_session,
    reference_generate,
    run_raw,
)
from test_exactness import assert_same

from cpchat import blas
from cpchat.bench.compare_algorithms import BenchUsageError
from cpchat.bench.shares import cpu_quota
from cpchat.core.estimate import PrefillCost, balanced_shares, rank_seconds
from cpchat.core.sharding import decode_owner, rank_tokens
from cpchat.errors import BadInput

MAX_TOKENS = 6
ALGORITHMS = ("pass_kv", "pass_q", "all_gather", "ulysses")


@pytest.mark.parametrize(("arch", "shares"), [("llama", "1,7"), ("mistral", "3,1,2"), ("qwen3", "5,1,1,2")])
def test_unequal_shares_give_mlx_lms_answer_with_every_algorithm(clusters, model_dir, arch, shares):
    """mistral slides a window, qwen3 normalises its queries and keys; 1, 2N+1 and 997 tokens."""
    weights = [int(w) for w in shares.split(",")]
    ranks = len(weights)
    path = model_dir(arch)
    cluster = clusters.get(ranks, path)
    for length in (1, 2 * ranks + 1, 997):
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, MAX_TOKENS)
        for algorithm in ALGORITHMS:
            cluster.reset(0)
            got, events, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS, shares)
            assert_same(got, expected)
            prefill = prefill_event(events)
            assert prefill.shares == rank_tokens(length, ranks, tuple(weights))
            assert sum(prefill.shares) == length
    # After the 997-token prompt each rank holds its share of it, and of the answer's tokens
    held = [r.kv_tokens for r in done_event(events).ranks]
    answer = [decode_owner(p, ranks, tuple(weights)) for p in range(length, length + MAX_TOKENS - 1)]
    assert held == [t + answer.count(r) for r, t in enumerate(rank_tokens(length, ranks, tuple(weights)))]
    assert held[weights.index(max(weights))] > held[weights.index(min(weights))] * 2


@pytest.mark.parametrize("decode", ["exchange", "ring", "lead", "gather"])
def test_every_decode_step_keeps_the_answer_in_the_shares(clusters, model_dir, decode):
    """A long answer's K/V lands on the ranks in proportion to their shares, and the tokens stay
    mlx-lm's, whichever way the step runs; a second turn under other shares goes on exactly."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    cluster.reset(0)
    ids = random_prompt(path, 61, seed=3)
    session = raw_session(cluster, path, "pass_kv", 40, shares="1,3")
    session.decode = decode
    tokens, events = next_turn(session, ids)
    assert_same(tokens, reference_generate(path, ids, 40))
    done = done_event(events)
    answer = done.generated_tokens - (done.generated_tokens == 40)
    held = [r.kv_tokens for r in done.ranks]
    answered = [h - t for h, t in zip(held, rank_tokens(len(ids), 2, (1, 3)), strict=True)]
    assert sum(answered) == answer and abs(answered[1] - 3 * answered[0]) <= 3

    history = ids + [t for t, _ in tokens]
    session.shares = (2, 1)
    follow = random_prompt(path, 29, seed=4)
    tokens, events = next_turn(session, follow)
    assert_same(tokens, reference_generate(path, history + follow, 40))
    assert prefill_event(events).shares == rank_tokens(len(follow) + (done.generated_tokens == 40), 2, (2, 1))


def test_a_hybrids_states_cross_unequal_chunks(clusters, model_dir):
    """Linear layers: chunk transforms folded in order and convolution halos from chunks of two sizes."""
    path = model_dir("qwen3_next")
    cluster = clusters.get(3, path)
    for length in (7, 101):
        ids = random_prompt(path, length, seed=length)
        cluster.reset(0)
        got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS, "1,4,2")
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))


def test_auto_shares_follow_the_measured_speeds(clusters, model_dir):
    """Local ranks with the same CPU allowance keep equal shares whatever their calibrations say; one
    held to half a core by a CPU quota (a cgroup, as the bench does) reports it, measures itself
    slower when the model loads, and gets the smaller share, which the estimate expects to be faster."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    session = raw_session(cluster, path, "pass_kv", 1)
    assert cluster.equally_fast and session.shares_for(8192, 0) is None
    try:
        with cpu_quota(cluster.ranks[1].local.process.pid, 0.5):
            cluster.load(str(path))
            assert [r.cpu_allowance for r in cluster.ranks] == [blas.usable_cores(), 0.5]
            assert not cluster.equally_fast
            shares = session.shares_for(8192, 0)
            assert shares is not None and shares[0] > 1.3 * shares[1]
            costs = cluster.rank_costs
            equal, auto = (max(rank_seconds(costs, 8192, 0, 2, s)) for s in (None, shares))
            assert equal / auto > 1.2
            assert session.workload(8192, 0).shares == shares  # the memory check sees the same shares
    except BenchUsageError as e:
        pytest.skip(str(e))  # no CPU cgroup to create (not root, or not Linux)
    finally:
        cluster.load(str(path))
    assert cluster.equally_fast


def test_balanced_shares_even_out_the_ranks_times():
    fast = PrefillCost(0.01, 1e-4, 2e-9, 0.0, 3e-9)
    slow = PrefillCost(0.01, 3e-4, 6e-9, 0.0, 9e-9)
    for tokens in (4096, 32768):
        shares = balanced_shares([fast, slow, fast], tokens, 1000, 2)
        times = rank_seconds([fast, slow, fast], tokens, 1000, 2, shares)
        assert max(times) / min(times) < 1.1
        assert abs(shares[0] - shares[2]) <= 2 and shares[0] > 2 * shares[1]
    assert balanced_shares([fast, fast], 4096, 0) is None
    assert balanced_shares([fast, slow], 3, 0) is None  # too short to share out


def test_shares_that_do_not_fit_the_ring_are_refused(clusters, model_dir):
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    with pytest.raises(BadInput, match="3 weights for 2 ranks"):
        raw_session(cluster, path, "pass_kv", 1, shares="1,2,3")
    with pytest.raises(ValueError, match="positive"):
        raw_session(cluster, path, "pass_kv", 1, shares="1,0")
