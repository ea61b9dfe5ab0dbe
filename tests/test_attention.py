import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpchat.core.attention import (
    add_sink,
    attention_over_blocks,
    fused_attention,
    merge_partials,
    partial_attention,
)


def reference(q, k, v, scale):
    """Single-pass causal attention of the last Lq positions over all Lk keys."""
    lq, lk = q.shape[2], k.shape[2]
    mask = mx.array(np.arange(lk - lq, lk)[:, None] >= np.arange(lk)[None, :])
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def reference64(q, k, v, scale):
    """The same in float64 numpy: the truth both float32 backends are held to."""
    qn, kn, vn = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    lq, lk = qn.shape[2], kn.shape[2]
    groups = qn.shape[1] // kn.shape[1]
    kn, vn = np.repeat(kn, groups, axis=1), np.repeat(vn, groups, axis=1)
    s = (qn * scale) @ kn.swapaxes(-1, -2)
    s = np.where(np.arange(lk - lq, lk)[:, None] >= np.arange(lk)[None, :], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ vn


@st.composite
def problems(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 4]))
    lk = draw(st.integers(1, 96))
    lq = draw(st.sampled_from([1, lk, max(1, lk // 3)]))
    d = draw(st.sampled_from([8, 16]))
    n_blocks = draw(st.integers(1, min(8, lk)))
    cuts = (
        sorted(
            draw(st.lists(st.integers(1, lk - 1), min_size=n_blocks - 1, max_size=n_blocks - 1, unique=True))
        )
        if lk > 1
        else []
    )
    magnitude = draw(st.sampled_from([1.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**16))
    tile = draw(st.sampled_from([4, 16, 1024]))
    return kv_heads, groups, lq, lk, d, cuts, magnitude, seed, tile


def random_qkv(kv_heads, groups, lq, lk, d, seed, dtype):
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, kv_heads * groups, lq, d), key=kq)
    k = mx.random.normal((1, kv_heads, lk, d), key=kk)
    v = mx.random.normal((1, kv_heads, lk, d), key=kv)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# The two tile backends: numpy (MLX on the CPU) and mlx.core (an accelerator).
BACKENDS = pytest.mark.parametrize("xp", [np, mx], ids=["numpy", "mlx"])


def run_blocks(q, k, v, scale, cuts, seed, tile, xp):
    """Shuffle key positions, cut into blocks, attend per block, merge."""
    lq, lk = q.shape[2], k.shape[2]
    order = np.random.default_rng(seed).permutation(lk)
    q_pos = np.arange(lk - lq, lk)
    parts = []
    for block in np.split(order, cuts):
        idx = mx.array(block)
        parts.append(partial_attention(q, k[:, :, idx], v[:, :, idx], q_pos, block, scale, tile=tile, xp=xp))
    rng = np.random.default_rng(seed + 1)
    return merge_partials([parts[i] for i in rng.permutation(len(parts))])


@BACKENDS
@settings(max_examples=60, deadline=None)
@given(problem=problems())
@example(problem=(1, 2, 31, 93, 16, [], 1e4, 15316, 4))  # the fused kernel itself is 1.06e-3 off here
def test_merged_blocks_equal_fused_attention_float32(problem, xp):
    kv_heads, groups, lq, lk, d, cuts, magnitude, seed, tile = problem
    q, k, v = random_qkv(kv_heads, groups, lq, lk, d, seed, mx.float32)
    scale = magnitude / d  # |scores| reach ~magnitude
    out, lse = run_blocks(q, k, v, scale, cuts, seed, tile, xp)
    expected = reference64(q, k, v, scale)
    assert out.dtype == mx.float32 and lse.dtype == mx.float32
    assert out.shape == expected.shape and lse.shape == expected.shape[:-1]
    error = np.abs(np.array(out) - expected).max()
    if magnitude <= 30:
        assert error <= 1e-5
    else:  # scores of ~1e4 carry ~1e-3 of float32 rounding, which moves near-tied weights:
        fused = np.abs(np.array(reference(q, k, v, scale)) - expected).max()
        assert error <= max(5e-4, 2 * fused)  # no worse than MLX's own fused float32 kernel
    assert mx.isfinite(lse).all().item()


@BACKENDS
@settings(max_examples=25, deadline=None)
@given(problem=problems())
def test_merged_blocks_in_bfloat16(problem, xp):
    kv_heads, groups, lq, lk, d, cuts, magnitude, seed, tile = problem
    q, k, v = random_qkv(kv_heads, groups, lq, lk, d, seed, mx.bfloat16)
    scale = min(magnitude, 30.0) / d
    out, _ = run_blocks(q, k, v, scale, cuts, seed, tile, xp)
    expected = reference(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale)
    assert out.dtype == mx.float32  # float32 until after the merge: a low-precision model rounds once
    assert mx.abs(out - expected).max().item() <= 2e-2


@BACKENDS
def test_row_that_sees_no_key_is_empty(xp):
    q = mx.ones((1, 2, 3, 4))
    k = mx.ones((1, 1, 2, 4))
    out, lse = partial_attention(q, k, k, [0, 5, 9], [5, 6], 0.5, xp=xp)
    assert out[:, :, 0].abs().max().item() == 0 and lse[:, :, 0].tolist() == [[float("-inf")] * 2]
    assert mx.isfinite(lse[:, :, 1:]).all().item()
    merged, merged_lse = merge_partials([(out, lse), (mx.zeros_like(out), mx.full(lse.shape, float("-inf")))])
    assert mx.allclose(merged, out).item()
    assert mx.array_equal(merged_lse, lse).item()


@BACKENDS
def test_long_sequence_is_tiled_and_exact(xp):
    mx.random.seed(3)
    q = mx.random.normal((1, 4, 3000, 16))
    k = mx.random.normal((1, 2, 3000, 16))
    v = mx.random.normal((1, 2, 3000, 16))
    pos = np.arange(3000)
    out, _ = partial_attention(q, k, v, pos, pos, 0.25, tile=512, xp=xp)
    assert mx.abs(out - reference(q, k, v, 0.25)).max().item() <= 1e-5


@pytest.mark.parametrize(
    "q_shape, k_shape, q_pos, k_pos, message",
    [
        ((1, 3, 2, 4), (1, 2, 2, 4), [0, 1], [0, 1], "multiple"),
        ((1, 2, 2, 4), (1, 2, 2, 8), [0, 1], [0, 1], "head dim"),
        ((1, 2, 2, 4), (1, 2, 2, 4), [0], [0, 1], "q_pos"),
        ((1, 2, 2, 4), (1, 2, 2, 4), [0, 1], [0, 1, 2], "k_pos"),
        ((2, 2, 4), (1, 2, 2, 4), [0, 1], [0, 1], "4-D"),
    ],
)
def test_bad_shapes_raise_value_error(q_shape, k_shape, q_pos, k_pos, message):
    with pytest.raises(ValueError, match=message):
        partial_attention(mx.zeros(q_shape), mx.zeros(k_shape), mx.zeros(k_shape), q_pos, k_pos, 1.0)


def test_merge_rejects_mismatched_parts():
    a = (mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3)))
    b = (mx.zeros((1, 2, 2, 4)), mx.zeros((1, 2, 2)))
    with pytest.raises(ValueError, match="shape"):
        merge_partials([a, b])
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


def blocks_in_a_window(problem, window, value_dim):
    """Queries, their positions, key blocks (positions in any order) and the float64 truth (out,
    lse) of attention over keys with 0 <= q_pos - k_pos < window (no bound if None); values may have
    their own head size (MLA)."""
    kv_heads, groups, lq, lk, d, cuts, _, seed, _ = problem
    q, k, v = random_qkv(kv_heads, groups, lq, lk, d, seed, mx.float32)
    if value_dim:
        v = mx.random.normal((1, kv_heads, lk, value_dim), key=mx.random.key(seed + 7))
    q_pos, k_pos = np.arange(lk - lq, lk), np.arange(lk)
    order = np.random.default_rng(seed).permutation(lk)
    blocks = [(k[:, :, mx.array(b)], v[:, :, mx.array(b)], b) for b in np.split(order, cuts)]
    qn, kn, vn = (np.repeat(np.array(a, np.float64), g, axis=1) for a, g in ((q, 1), (k, groups), (v, groups))
                  )
    delta = q_pos[:, None] - k_pos[None, :]
    s = np.where((delta >= 0) & (delta < (window or lk + 1)), 0.3 * qn @ kn.swapaxes(-1, -2), -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return q, q_pos, blocks, ((p / p.sum(axis=-1, keepdims=True)) @ vn, np.log(np.exp(s).sum(axis=-1)))


def assert_matches(got, expected):
    out, lse = got
    assert out.shape == expected[0].shape
    assert np.abs(np.array(out) - expected[0]).max() <= 5e-5
    assert np.allclose(np.array(lse), expected[1], atol=1e-4)


@BACKENDS
@settings(max_examples=40, deadline=None)
@given(problem=problems(), window=st.integers(1, 40), value_dim=st.sampled_from([None, 24]))
def test_sliding_window_and_value_size_in_blocks(problem, window, value_dim, xp):
    """Keys in the window, cut into blocks and merged, equal one float64 pass."""
    q, q_pos, blocks, expected = blocks_in_a_window(problem, window, value_dim)
    parts = [partial_attention(q, k, v, q_pos, k_pos, 0.3, window=window, tile=problem[-1], xp=xp)
             for k, v, k_pos in blocks]
    assert_matches(merge_partials(parts), expected)


@settings(max_examples=60, deadline=None)
@given(problem=problems(), window=st.one_of(st.none(), st.integers(1, 40)),
       value_dim=st.sampled_from([None, 24]))
def test_attention_over_blocks_is_one_softmax_over_every_block(problem, window, value_dim):
    """A decode step's attention over a rank's blocks of keys (some wholly out of the window) equals
    one float64 pass over all the keys, out and lse."""
    q, q_pos, blocks, expected = blocks_in_a_window(problem, window, value_dim)
    assert_matches(attention_over_blocks(q, blocks, q_pos, 0.3, window), expected)


def test_attention_over_blocks_refuses_a_query_that_sees_no_key():
    q, k, v = random_qkv(1, 2, 1, 4, 8, 0, mx.float32)
    with pytest.raises(ValueError, match="sees no key"):
        attention_over_blocks(q, [(k, v, np.arange(4))], np.array([10]), 1.0, window=3)


@BACKENDS
@pytest.mark.parametrize("window", [None, 5])
def test_sink_joins_the_merge_once_like_the_fused_kernel(xp, window):
    """gpt-oss's attention sinks: partials of 3 blocks, merged, then the sink, equal MLX's fused
    kernel given the same sinks and mask."""
    q, k, v = random_qkv(2, 2, 9, 30, 16, 3, mx.float32)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    q_pos, k_pos = np.arange(21, 30), np.arange(30)
    parts = [partial_attention(q, k[:, :, b[0]:b[-1] + 1], v[:, :, b[0]:b[-1] + 1], q_pos, b, 0.25,
                               window=window, xp=xp) for b in np.split(k_pos, [7, 19])]
    out = add_sink(*merge_partials(parts), sinks)
    delta = q_pos[:, None] - k_pos[None, :]
    mask = mx.array((delta >= 0) & (delta < (window or 1 << 30)))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=sinks)
    assert mx.abs(out - expected).max().item() <= 1e-5


@settings(max_examples=40, deadline=None)
@given(problem=problems(), window=st.one_of(st.none(), st.integers(1, 40)), sinks=st.booleans(),
       value_dim=st.sampled_from([None, 24]))
def test_fused_attention_over_keys_in_any_order_equals_one_pass(problem, window, sinks, value_dim):
    """One rank on a GPU: MLX's fused kernel over the keys as the shard holds them (any order here),
    the queries in tiles, each masked only where some pair is not visible, the sinks given along;
    values may have their own head size (MLA)."""
    kv_heads, groups, lq, lk, d, _, _, seed, tile = problem
    q, k, v = random_qkv(kv_heads, groups, lq, lk, d, seed, mx.float32)
    if value_dim:
        v = mx.random.normal((1, kv_heads, lk, value_dim), key=mx.random.key(seed + 7))
    logits = mx.linspace(-1, 1, q.shape[1]) if sinks else None
    q_pos, k_pos = np.arange(lk - lq, lk), np.random.default_rng(seed).permutation(lk)
    out = fused_attention(q, k, v, q_pos, k_pos, 0.3, window=window, sinks=logits, tile=tile)
    qn, kn, vn = (np.repeat(np.array(a, np.float64), g, axis=1)
                  for a, g in ((q, 1), (k, groups), (v, groups)))
    delta = q_pos[:, None] - k_pos[None, :]
    s = np.where((delta >= 0) & (delta < (window or lk + 1)), 0.3 * qn @ kn.swapaxes(-1, -2), -np.inf)
    if sinks:  # one more logit a head, with a zero value
        s = np.concatenate([s, np.broadcast_to(np.array(logits, np.float64)[None, :, None, None],
                                               (*s.shape[:-1], 1))], axis=-1)
        vn = np.concatenate([vn, np.zeros((*vn.shape[:2], 1, vn.shape[-1]))], axis=2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    expected = (p / p.sum(axis=-1, keepdims=True)) @ vn
    assert out.shape == expected.shape and out.dtype == q.dtype
    assert np.abs(np.array(out) - expected).max() <= 5e-5


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("window", [None, 50])
def test_one_query_reads_the_stored_keys_as_the_float32_product_does(monkeypatch, dtype, window):
    """A decode step's attention by the compiled kernels, over keys and values as the K/V shard holds
    them (a view of the head of a larger buffer, in the model's 16-bit dtype), equals numpy's over
    float32 copies of them (float64 truth within float32 rounding)."""
    import cpchat.core.attention as attention

    assert attention.one_query_kernel() is not None  # a silent fallback would pass the comparison
    q = mx.random.normal((1, 6, 1, 32))
    k_buffer, v_buffer = (mx.random.normal((1, 2, 400, 32)).astype(dtype) for _ in range(2))
    k, v = k_buffer[:, :, :300], v_buffer[:, :, :300]
    positions = np.arange(300)
    kernel = attention.partial_attention(q, k, v, [299], positions, 0.2, window=window)
    monkeypatch.setattr(attention, "one_query_kernel", lambda: None)
    numpy = attention.partial_attention(q, k, v, [299], positions, 0.2, window=window)
    for a, b in zip(kernel, numpy, strict=True):
        assert a.shape == b.shape and mx.abs(a - b).max().item() < 1e-5
    seen = slice(None) if window is None else slice(300 - window, 300)
    truth = reference64(q, k[:, :, seen], v[:, :, seen], 0.2)
    assert np.abs(np.array(kernel[0]) - truth).max() < 1e-5
