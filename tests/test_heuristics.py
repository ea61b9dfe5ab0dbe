"""The cost model that picks a prefill's algorithm (cpchat/core/heuristics.py)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpchat.core.algorithms import PREFILL_ALGORITHMS
from cpchat.core.heuristics import (
    Measured,
    Workload,
    choose_algorithm,
    choose_decode,
    decode_estimates,
    prefill_estimates,
)


def workload(**kw) -> Workload:
    base = dict(new_tokens=4096, cached_tokens=0, ranks=4, q_heads=16, kv_heads=4, head_dim=128,
                value_dim=128, bytes_per_element=2, layers=8)
    return Workload(**(base | kw))


def measured(**kw) -> Measured:
    base = dict(per_pair_s=1e-9, link_bytes_per_s=1e9, hop_latency_s=1e-3, exchange_latency_s=1.5e-3)
    return Measured(**(base | kw))


@given(
    new=st.integers(1, 200_000),
    cached=st.integers(0, 1_000_000),
    ranks=st.integers(2, 16),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    per_pair=st.floats(1e-13, 1e-6),
    bandwidth=st.floats(1e6, 1e12),
)
def test_metas_rule_is_the_special_case_of_two_algorithms_and_no_latency(
        new, cached, ranks, kv_heads, group, per_pair, bandwidth):
    """Wherever Meta's rule says pass-KV (the K/V block is no bigger than the queries, or its transfer
    hides behind one block's compute), the model restricted to pass-KV and pass-Q says so too."""
    w = workload(new_tokens=new, cached_tokens=cached, ranks=ranks, q_heads=kv_heads * group,
                 kv_heads=kv_heads)
    m = measured(per_pair_s=per_pair, link_bytes_per_s=bandwidth, hop_latency_s=0.0, exchange_latency_s=0.0)
    miss_rule = new / (new + cached) >= 2 * w.kv_heads / w.q_heads
    block = (new + cached) / ranks * w.kv_heads * 2 * w.head_dim * w.bytes_per_element
    compute_per_step = (new * (new + 1) / 2 + new * cached) * per_pair / (w.layers * ranks * ranks)
    hides = block / bandwidth <= compute_per_step
    if miss_rule or hides:
        assert choose_algorithm(w, m, ("pass_kv", "pass_q")).algorithm == "pass_kv"


def test_papers_example_picks_pass_q_for_a_short_follow_up_on_a_slow_link():
    """Llama 3 405B's heads (128 query, 8 KV): a follow-up of 100 tokens after 100,000 cached, on a
    link too slow to hide anything, moves far less as queries than as keys and values."""
    w = workload(new_tokens=100, cached_tokens=100_000, q_heads=128, kv_heads=8)
    c = choose_algorithm(w, measured(link_bytes_per_s=1e8))
    assert c.algorithm == "pass_q"
    assert c.estimates_s["pass_q"] < c.estimates_s["pass_kv"] / 10


def test_a_long_first_prompt_on_a_fast_link_costs_its_compute_with_pass_kv():
    w = workload(new_tokens=65_536)
    m = measured(per_pair_s=1e-9, link_bytes_per_s=1e10)
    estimates = prefill_estimates(w, m)
    compute = 65_536 * 65_537 / 2 * 1e-9 / 4
    assert estimates["pass_kv"] == pytest.approx(compute)
    assert choose_algorithm(w, m).algorithm == "pass_kv"


def test_latency_bound_prefills_gather_at_once():
    """Little compute and high per-message latency: one exchange beats N-1 dependent hops."""
    w = workload(new_tokens=64, ranks=4)
    c = choose_algorithm(w, measured(per_pair_s=1e-12, hop_latency_s=2e-3, exchange_latency_s=2.5e-3))
    assert c.algorithm == "all_gather"
    assert "all-gather" in c.reason


def test_ulysses_wins_when_multi_head_transfers_dominate():
    """MHA over a slow link: all-to-all moves 3/4 of (Q + K/V + O) once, where pass-KV moves
    three whole K/V blocks one after another and pass-Q four laps of queries and outputs."""
    w = workload(new_tokens=8192, ranks=4, q_heads=16, kv_heads=16)
    c = choose_algorithm(w, measured(per_pair_s=1e-12, link_bytes_per_s=1e8))
    assert c.algorithm == "ulysses"


def test_an_uneven_head_split_costs_ulysses_its_imbalance_and_the_copied_key_heads():
    even = prefill_estimates(workload(ranks=4, q_heads=16, kv_heads=4), measured())
    uneven = prefill_estimates(workload(ranks=3, q_heads=16, kv_heads=4), measured())
    cut_groups = prefill_estimates(workload(ranks=4, q_heads=8, kv_heads=2, head_dim=256, value_dim=256),
                                   measured())
    assert uneven["ulysses"] > even["ulysses"]
    assert cut_groups["ulysses"] > even["ulysses"]  # same bytes per head, but 4:1 groups cut in two


def test_one_rank_has_nothing_to_move():
    c = choose_algorithm(workload(ranks=1), measured())
    assert len(set(c.estimates_s.values())) == 1
    assert c.algorithm == "pass_kv" and c.reason == "one rank: nothing crosses"


def test_candidates_limit_the_choice_and_ties_go_to_the_first():
    w, m = workload(new_tokens=64), measured(per_pair_s=1e-12, hop_latency_s=2e-3, exchange_latency_s=2.5e-3)
    assert choose_algorithm(w, m, ("pass_kv", "pass_q")).algorithm == "pass_kv"
    assert set(choose_algorithm(w, m, ("ulysses",)).estimates_s) == {"ulysses"}
    assert set(choose_algorithm(w, m).estimates_s) == set(PREFILL_ALGORITHMS)
    with pytest.raises(ValueError, match="no known algorithm"):
        choose_algorithm(w, m, ("zigzag",))


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_decode_in_one_exchange_never_costs_more_than_the_ring(ranks):
    w, m = workload(new_tokens=1, cached_tokens=16_384, ranks=ranks), measured(exchange_latency_s=1e-3)
    d = decode_estimates(w, m)
    assert d["exchange"] <= d["ring"]
    assert (d["exchange"] == pytest.approx(d["ring"])) == (ranks == 2)
    # 36 layers at N = 4 over the ring: 108 hops per token.
    assert decode_estimates(workload(ranks=4, layers=36), measured(hop_latency_s=1e-3))["ring"] >= 0.108


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(new_tokens=0), "new_tokens"),
        (dict(cached_tokens=-1), "cached_tokens"),
        (dict(q_heads=12, kv_heads=8), "multiple"),
        (dict(ranks=0), "positive"),
        (dict(layers=0), "positive"),
    ],
)
def test_bad_workloads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        workload(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(per_pair_s=0), "positive"), (dict(link_bytes_per_s=-1), "positive"),
     (dict(hop_latency_s=-1), "negative")],
)
def test_bad_measurements(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measured(**kwargs)


def test_without_a_spare_core_transfers_add_to_compute():
    """Ranks that compute on every core of their host have none left to move tensors: pass-KV's
    hops then cost their full time, and for a multi-head model Ulysses, which moves fewer bytes,
    wins where pass-KV's hidden transfers won before."""
    w = workload(new_tokens=16384, q_heads=16, kv_heads=16, head_dim=32, value_dim=32,
                 bytes_per_element=4, layers=2)
    spare = measured(per_pair_s=2.6e-7, link_bytes_per_s=1.1e8)  # as the 2-core bench host measured
    busy = measured(per_pair_s=2.6e-7, link_bytes_per_s=1.1e8, overlap=False)
    assert choose_algorithm(w, spare).algorithm == "pass_kv"
    c = choose_algorithm(w, busy)
    assert c.algorithm == "ulysses" and "no spare core" in c.reason
    hidden, added = prefill_estimates(w, spare), prefill_estimates(w, busy)
    kv_block = 16384 / 4 * 16 * 64 * 4
    assert added["pass_kv"] - hidden["pass_kv"] == pytest.approx(
        w.layers * 3 * (1e-3 + kv_block / 1.1e8), rel=1e-6)  # compute hid every hop before
    assert added["ulysses"] == hidden["ulysses"] and added["pass_q"] == hidden["pass_q"]


def test_decode_takes_the_ring_only_where_three_hops_beat_one_exchange():
    w = workload(ranks=4)
    assert choose_decode(w, measured(hop_latency_s=1e-3, exchange_latency_s=1.5e-3)) == "exchange"
    # Measured here with shared memory and four ranks on two cores: hops of 0.2 ms, exchanges of 1.2 ms.
    assert choose_decode(w, measured(hop_latency_s=2e-4, exchange_latency_s=1.2e-3)) == "ring"
    same = measured(hop_latency_s=1e-3, exchange_latency_s=1e-3)
    assert choose_decode(workload(ranks=2), same) == "exchange"  # one peer: the same message either way


def test_decode_runs_on_rank_0_alone_only_where_every_rank_shares_one_machine_and_no_state():
    """On one machine the other ranks' copies of the weight products only take cores from rank 0's:
    the gather step where rank 0 can hold the other ranks' K/V, else the lead step, whatever the
    latencies; across machines, or with a state every rank must advance (linear layers), an exchange
    of partial outputs."""
    fast_hops = measured(hop_latency_s=2e-4, exchange_latency_s=1.2e-3, one_machine=True)
    assert choose_decode(workload(ranks=4), fast_hops) == "lead"
    assert choose_decode(workload(ranks=4), fast_hops, copy_fits=True) == "gather"
    assert choose_decode(workload(ranks=2), measured(one_machine=True)) == "lead"
    assert choose_decode(workload(ranks=4, states=True), fast_hops, copy_fits=True) == "ring"
    assert choose_decode(workload(ranks=1), measured(one_machine=True), copy_fits=True) == "exchange"
    assert choose_decode(workload(ranks=4), measured(one_machine=False), copy_fits=True) == "exchange"
    d = decode_estimates(workload(ranks=4), measured())
    assert d["lead"] > d["exchange"]  # a query more on the wire: its gain is compute, not transfer
