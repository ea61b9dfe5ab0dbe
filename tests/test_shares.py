"""Unequal shares (--shares, issue #42) through real ranks: each rank's head and tail chunks sized by
its share, every prefill algorithm and decode step still mlx-lm's answer, with lengths that no
share divides; the K/V each rank holds follows its share; auto shares follow measured speeds."""

import pytest
from helpers import assert_same, done_event, next_turn, prefill_event, random_prompt, raw_session, run_raw
from references import reference_generate

from cpchat import blas
from cpchat.bench.compare_algorithms import BenchUsageError
from cpchat.bench.shares import cpu_quota
from cpchat.client.cluster import Cluster
from cpchat.core.estimate import PrefillCost, balanced_shares, rank_seconds
from cpchat.dirs import new_user
from cpchat.errors import BadInput

MAX_TOKENS = 6
ALGORITHMS = ("pass_kv", "pass_q", "all_gather", "ulysses")


# Each rank's real tokens of a prompt, and of the answer's first five tokens after a 997-token prompt, worked
# out by hand: chunks of c_i = ceil(ceil(T/2) * s_i / sum(s)), head chunks in rank order, tails mirrored, the
# padding at the end; answer tokens by smooth weighted round robin, one cycle of sum(s) positions
# ((1,7): 1 1 1 0 1 1 1 1; (3,1,2): 0 2 0 1 2 0; (5,1,1,2): 0 3 0 1 0 2 0 3 0).
SPLITS = {
    "1,7": ({1: [1, 0], 5: [1, 4], 997: [123, 874]}, [0, 5]),
    "3,1,2": ({1: [1, 0, 0], 7: [2, 1, 4], 997: [495, 168, 334]}, [2, 1, 2]),
    "5,1,1,2": ({1: [1, 0, 0, 0], 9: [3, 1, 1, 4], 997: [551, 112, 112, 222]}, [3, 0, 0, 2]),
}


@pytest.mark.parametrize(("arch", "shares"), [("llama", "1,7"), ("mistral", "3,1,2"), ("qwen3", "5,1,1,2")])
def test_unequal_shares_give_mlx_lms_answer_with_every_algorithm(clusters, model_dir, arch, shares):
    """mistral slides a window, qwen3 normalises its queries and keys; 1, 2N+1 and 997 tokens."""
    weights = [int(w) for w in shares.split(",")]
    ranks = len(weights)
    splits, answer = SPLITS[shares]
    path = model_dir(arch)
    cluster = clusters.get(ranks, path)
    for length, split in splits.items():
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, MAX_TOKENS)
        for algorithm in ALGORITHMS:
            cluster.reset(0)
            got, events, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS, shares)
            assert_same(got, expected)
            assert prefill_event(events).shares == split
    # After the 997-token prompt each rank holds its share of it (within 1 %), and of the answer's tokens
    assert len(expected) == MAX_TOKENS  # five of them reach the ranks; the last is never read
    held = [r.kv_tokens for r in done_event(events).ranks]
    assert held == [t + a for t, a in zip(split, answer, strict=True)]
    assert all(abs(t / length - w / sum(weights)) < 0.01 for t, w in zip(split, weights, strict=True))


@pytest.mark.parametrize("decode", ["exchange", "ring", "lead", "gather"])
def test_every_decode_step_keeps_the_answer_in_the_shares(clusters, model_dir, decode):
    """A long answer's K/V lands on the ranks in proportion to their shares, and the tokens stay
    mlx-lm's, whichever way the step runs; a second turn under other shares goes on exactly."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    cluster.reset(0)
    ids = random_prompt(path, 61, seed=3)
    session = raw_session(cluster, path, "pass_kv", 40, shares="1,3")
    session.planner.decode = decode
    tokens, events = next_turn(session, ids)
    assert_same(tokens, reference_generate(path, ids, 40))
    done = done_event(events)
    answer = done.generated_tokens - (done.generated_tokens == 40)
    held = [r.kv_tokens for r in done.ranks]
    answered = [h - t for h, t in zip(held, [13, 48], strict=True)]  # 61 tokens shared 1:3, by hand
    assert sum(answered) == answer and abs(answered[1] - 3 * answered[0]) <= 3

    history = ids + [t for t, _ in tokens]
    session.planner.shares = (2, 1)
    follow = random_prompt(path, 29, seed=4)
    tokens, events = next_turn(session, follow)
    assert_same(tokens, reference_generate(path, history + follow, 40))
    # 29 new tokens (30 with the answer's last, unread when it stopped at 40), shared 2:1 by hand
    assert prefill_event(events).shares == {29: [19, 10], 30: [20, 10]}[len(follow) + (answer == 39)]


def test_a_hybrids_states_cross_unequal_chunks(clusters, model_dir):
    """Linear layers: chunk transforms folded in order and convolution halos from chunks of two sizes."""
    path = model_dir("qwen3_next")
    cluster = clusters.get(3, path)
    for length in (7, 101):
        ids = random_prompt(path, length, seed=length)
        cluster.reset(0)
        got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS, "1,4,2")
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.alone
def test_auto_shares_follow_the_measured_speeds(model_dir, tmp_path, monkeypatch):
    """Local ranks with the same CPU allowance keep equal shares whatever their calibrations say; one
    held to half a core by a CPU quota (a cgroup, as the bench does) reports it, measures itself
    slower when the model loads, and gets the smaller share, which the estimate expects to be faster.
    Ranks of its own, with no measures kept: the measures compared are made in this test, alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", new_user(tmp_path)["XDG_CACHE_HOME"])
    path = model_dir("llama")
    cluster = Cluster.launch(2)
    try:
        cluster.connect()
        cluster.load(str(path))
        session = raw_session(cluster, path, "pass_kv", 1)
        assert cluster.equally_fast and session.planner.shares_for(8192, 0) is None
        with cpu_quota(cluster.ranks[1].local.process.pid, 0.5):
            cluster.load(str(path))
            assert [r.cpu_allowance for r in cluster.ranks] == [blas.usable_cores(), 0.5]
            assert not cluster.equally_fast
            shares = session.planner.shares_for(8192, 0)
            assert shares is not None and shares[0] > shares[1]  # how much: `cpchat bench --shares`
            costs = cluster.rank_costs
            equal, auto = (max(rank_seconds(costs, 8192, 0, 2, s)) for s in (None, shares))
            assert auto < equal
            assert session.planner.workload(8192, 0).shares == shares  # the memory check sees the same shares
        cluster.load(str(path))
        assert cluster.equally_fast
    except BenchUsageError as e:
        pytest.skip(str(e))  # no CPU cgroup to create (not root, or not Linux)
    finally:
        cluster.close()


def test_a_rank_measures_a_model_once(clusters, model_dir):
    """A rank that loads a model it measured before keeps that measurement (switching back costs no
    calibration; a CPU quota, above, makes it measure again); another model it measures."""
    llama, qwen3 = model_dir("llama"), model_dir("qwen3")
    cluster = clusters.get(2, llama)
    first = list(cluster.rank_costs)
    cluster.load(str(qwen3))
    other = list(cluster.rank_costs)
    cluster.load(str(llama))
    assert cluster.rank_costs == first and other != first


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
