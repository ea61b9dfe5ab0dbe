import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpchat.core.sharding import (
    chunk_lengths,
    decode_owner,
    head_split,
    head_tail_layout,
    head_tail_positions,
    owner_of,
    padded_length,
    rank_tokens,
)


@pytest.mark.parametrize("n", range(1, 9))
def test_every_position_on_exactly_one_rank(n):
    for seq_len in range(1, 301):
        held = [head_tail_positions(seq_len, n, r) for r in range(n)]
        flat = sorted(p for rank in held for p in rank)
        assert flat == list(range(seq_len))
        for r, positions in enumerate(held):
            assert all(owner_of(p, seq_len, n) == r for p in positions)


@pytest.mark.parametrize("n", range(1, 9))
def test_causal_work_is_balanced_within_one_chunk(n):
    for seq_len in range(1, 301):
        chunk = padded_length(seq_len, n) // (2 * n)
        # A query at position p sees p + 1 keys.
        work = [sum(p + 1 for p in head_tail_positions(seq_len, n, r)) for r in range(n)]
        # The costliest chunk (the last, before padding drops some of it) is chunk * padded pairs.
        assert max(work) - min(work) <= chunk * padded_length(seq_len, n)


def test_layout_rows_are_chunks_i_and_mirror():
    layout = head_tail_layout(10, 2, 0)  # padded to 12, chunks of 3
    assert layout.starts == (0, 9) and layout.chunk == 3
    assert layout.positions() == [0, 1, 2, 9, 10, 11]
    assert layout.real_mask() == [True, True, True, True, False, False]
    assert head_tail_positions(10, 2, 1) == [3, 4, 5, 6, 7, 8]


# Worked out by hand: c_i = ceil(ceil(T/2) * s_i / sum(s)); rank i's head chunk follows the head chunks of
# ranks before it, its tail chunk mirrors it from the end of the padded sequence (2 * sum(c)).
UNEQUAL = [
    # T, shares, c, each rank's real positions
    (10, (1, 3), [2, 4], [[0, 1], list(range(2, 10))]),  # padded 12: rank 0's tail [10, 12) is padding
    (7, (3, 1, 2), [2, 1, 2], [[0, 1], [2], [3, 4, 5, 6]]),  # padded 10
    (997, (1, 7), [63, 437], [[*range(63), *range(937, 997)], list(range(63, 937))]),  # padded 1000
    (9, (5, 1, 1, 2), [3, 1, 1, 2], [[0, 1, 2], [3], [4], [5, 6, 7, 8]]),  # padded 14
]


@pytest.mark.parametrize("seq_len, shares, chunks, positions", UNEQUAL)
def test_unequal_shares_by_hand(seq_len, shares, chunks, positions):
    n = len(shares)
    assert chunk_lengths(seq_len, n, shares) == chunks
    assert [head_tail_positions(seq_len, n, r, shares) for r in range(n)] == positions
    assert rank_tokens(seq_len, n, shares) == [len(p) for p in positions]
    assert all(owner_of(p, seq_len, n, shares) == r for r, held in enumerate(positions) for p in held)


def test_decoded_tokens_go_round_robin_by_share():
    """Smooth weighted round robin, by hand: each rank as often as its share, spread out."""
    cycles = {(1, 7): [1, 1, 1, 0, 1, 1, 1, 1], (3, 1, 2): [0, 2, 0, 1, 2, 0],
              (5, 1, 1, 2): [0, 3, 0, 1, 0, 2, 0, 3, 0], (2, 2): [0, 1], (1, 1, 1): [0, 1, 2]}
    for shares, cycle in cycles.items():
        n = len(shares)
        assert [decode_owner(p, n, shares) for p in range(2 * len(cycle))] == cycle * 2, shares


@pytest.mark.parametrize(
    "args, message",
    [((10, 0, 0), "num_ranks"), ((0, 2, 0), "seq_len"), ((10, 2, 2), "rank"), ((10, 2, -1), "rank")],
)
def test_bad_arguments_name_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        head_tail_positions(*args)


@given(kv_heads=st.integers(1, 16), group=st.integers(1, 8), ranks=st.integers(1, 40))
def test_ulysses_head_split_covers_every_query_head_once_with_its_key_head(kv_heads, group, ranks):
    q_heads = kv_heads * group
    shares = head_split(q_heads, kv_heads, ranks)
    assert len(shares) == ranks
    assert [h for s in shares for h in range(s.start, s.stop)] == list(range(q_heads))
    sizes = [s.stop - s.start for s in shares]
    assert max(sizes) - min(sizes) <= 1
    for s in shares:
        keys = list(s.kv_index)
        if s.whole_groups:  # a query group stays whole: its key heads once each, as GQA
            assert keys == list(range(s.start // group, s.stop // group))
        else:  # one key head per query head: the head each query reads in the model
            assert keys == [h // group for h in range(s.start, s.stop)]


def test_a_group_cut_between_ranks_sends_its_key_head_to_both():
    shares = head_split(4, 2, 4)  # the test models' heads over 4 ranks
    assert [list(s.kv_index) for s in shares] == [[0], [0], [1], [1]]
    assert not any(s.whole_groups for s in shares)
    assert [s.whole_groups for s in head_split(4, 2, 2)] == [True, True]
    with pytest.raises(ValueError):
        head_split(6, 4, 2)
