import pytest

from cpchat.core.heuristics import explain_algorithm, select_algorithm

SLOW_RING = dict(flops_per_s=1e15, bandwidth_bytes_per_s=1.0)  # token threshold out of reach


def test_papers_example_miss_rate_threshold():
    c = explain_algorithm(100, 0, num_kv_heads=8, num_q_heads=128, num_ranks=4, **SLOW_RING)
    assert c.miss_rate_threshold == pytest.approx(0.125)


@pytest.mark.parametrize(
    "new, cached, expected",
    [
        (125, 875, "pass_kv"),  # miss rate exactly 0.125
        (126, 874, "pass_kv"),
        (124, 876, "pass_q"),
        (1000, 0, "pass_kv"),
    ],
)
def test_miss_rate_rule_at_and_around_threshold(new, cached, expected):
    assert select_algorithm(new, cached, 8, 128, 4, **SLOW_RING) == expected


def test_token_threshold_rule():
    # T >= N*C*NKV*e / (2*NH*BW) = 4 * 1e12 * 8 * 2 / (2 * 128 * 1e10) = 25
    kw = dict(num_kv_heads=8, num_q_heads=128, num_ranks=4, flops_per_s=1e12, bandwidth_bytes_per_s=1e10)
    c = explain_algorithm(25, 10_000, **kw)
    assert c.token_threshold == pytest.approx(25)
    assert c.algorithm == "pass_kv"
    assert select_algorithm(24, 10_000, **kw) == "pass_q"


def test_decode_is_pass_q():
    assert select_algorithm(1, 4096, 8, 8, 4, flops_per_s=1e12, bandwidth_bytes_per_s=1e12) == "pass_q"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(new_tokens=0), "new_tokens"),
        (dict(num_q_heads=12, num_kv_heads=8), "multiple"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(flops_per_s=0), "positive"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = (
        dict(
            new_tokens=10,
            cached_tokens=0,
            num_kv_heads=2,
            num_q_heads=8,
            num_ranks=2,
            flops_per_s=1e9,
            bandwidth_bytes_per_s=1e9,
        )
        | kwargs
    )
    with pytest.raises(ValueError, match=message):
        select_algorithm(**args)
