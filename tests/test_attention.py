import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpchat.core.attention import merge_partials, partial_attention


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
    assert out.dtype == mx.bfloat16
    assert mx.abs(out.astype(mx.float32) - expected).max().item() <= 2e-2


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
