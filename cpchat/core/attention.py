"""Partial causal attention with its log-sum-exp, and the exact merge of partials.

For one query row q and a set of keys K with values V,

    s_j = scale * q . k_j          (only keys with 0 <= q_pos - k_pos < window)
    lse = log sum_j exp(s_j)
    out = sum_j exp(s_j - lse) v_j

(window = infinity for full causal attention). Keys and values may differ in
head size (MLA).

Two partials over disjoint key sets merge exactly:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

A row that saw no key has lse = -inf and out = 0, and contributes nothing.
An attention sink (one learned logit per head, with no value) joins the
normaliser once, after the merge: `add_sink`.

Attention is computed in (query tile x key tile) blocks with an online softmax,
so memory stays bounded; tiles wholly in the future or wholly out of the window
are skipped and wholly visible tiles need no mask. A tile never spans a break
in the positions (a rank's head chunk and its tail chunk) longer than a few
tokens: across one, its earlier rows would be computed for every key only its
later rows see. Outputs stay float32 until the caller casts the merged result,
so low-precision models round once.
"""

from __future__ import annotations

import functools
from types import ModuleType

import mlx.core as mx
import numpy as np

TILE = 1024
MIN_RUN = TILE // 8  # runs of positions shorter than this (decoded tokens, one a rank in N) share tiles
_NEG_INF = float("-inf")


def _positions(pos: mx.array | np.ndarray | list[int], length: int, name: str) -> np.ndarray:
    host = np.asarray(pos)
    if host.ndim != 1 or host.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {list(host.shape)}")
    if length and not np.issubdtype(host.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {host.dtype}")
    return host.astype(np.int64)


def _check_shapes(q: mx.array, k: mx.array, v: mx.array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v disagree in batch, heads or length: {k.shape} vs {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch and head dim of q {q.shape} and k {k.shape} must match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]})")


def partial_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    q_pos: mx.array | np.ndarray | list[int],
    k_pos: mx.array | np.ndarray | list[int],
    scale: float,
    window: int | None = None,
    tile: int = TILE,
    xp: ModuleType | None = None,
) -> tuple[mx.array, mx.array]:
    """Causal attention of q over (k, v) where key j is visible to query i iff
    0 <= q_pos[i] - k_pos[j] < window (no upper bound when window is None).
    Returns out [B, Hq, Lq, Dv] and lse [B, Hq, Lq], both float32 (lse = -inf,
    with out = 0, for rows that see no key).

    The tiles run in `xp`: numpy when MLX computes on the CPU (its SIMD exp is
    about 25x faster than MLX's CPU exp, which dominates the tile cost),
    otherwise mlx.core, on the accelerator."""
    _check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    groups = Hq // Hkv
    qp = _positions(q_pos, Lq, "q_pos")
    kp = _positions(k_pos, Lk, "k_pos")
    if xp is None:
        xp = np if mx.default_device() == mx.cpu else mx
    if xp is np and Lq == 1 and Hq * Lk <= tile * tile:
        return _one_query(q, k, v, int(qp[0]), kp, scale, window)
    qg, kt, vf = (a.astype(mx.float32) for a in (q, k.swapaxes(-1, -2), v))
    if xp is np:
        qg, kt, vf = np.asarray(qg), np.asarray(kt), np.asarray(vf)  # views of MLX's buffers
        if groups * Lq >= tile:
            kt = np.ascontiguousarray(kt)  # many queries per key tile: a transposing copy pays off
    # Grouped-query attention: fold each KV head's G query heads into the row axis.
    qg = qg.reshape(B, Hkv, groups, Lq, D)

    outs, lses = [], []
    for q0, q1 in tile_bounds(qp, tile):
        tq = q1 - q0
        qt = (qg[:, :, :, q0:q1] * scale).reshape(B, Hkv, groups * tq, D)
        # Bound the score block to about tile x tile per KV head: few queries (decode) get long key tiles.
        k_tile = max(tile, tile * tile // (groups * tq))
        out, lse = _query_tile(xp, qt, kt, vf, np.tile(qp[q0:q1], groups), kp, k_tile, window)
        out = out.reshape(B, Hkv, groups, tq, Dv)
        lse = lse.reshape(B, Hkv, groups, tq)
        if xp is mx and Lq > tile:
            mx.eval(out, lse)  # bound memory: one query tile's graph at a time
        outs.append(out)
        lses.append(lse)

    out = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=3)
    lse = lses[0] if len(lses) == 1 else xp.concatenate(lses, axis=3)
    return mx.array(out.reshape(B, Hq, Lq, Dv)), mx.array(lse.reshape(B, Hq, Lq))


def _one_query(q: mx.array, k: mx.array, v: mx.array, q_pos: int, k_pos: np.ndarray, scale: float,
               window: int | None) -> tuple[mx.array, mx.array]:
    """`partial_attention` of one query position (a decode step's) in numpy, every score at once: none
    of the tiles' fixed costs (6 heads over 2,048 keys: 0.2 ms a layer against the tiles' 0.43); the
    keys and values read as stored, by compiled kernels, where they can run."""
    B, Hq, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    visible = _visible(np, np.array([q_pos]), k_pos, window)[0]
    if not visible.any():
        return mx.zeros((B, Hq, 1, Dv), mx.float32), mx.full((B, Hq, 1), _NEG_INF, mx.float32)
    qn = np.asarray(q.astype(mx.float32)).reshape(B, Hkv, Hq // Hkv, D)
    kernel = one_query_kernel() if B == 1 and k.dtype == v.dtype and k.dtype in _STORED_KINDS else None
    if kernel is not None:
        kind, kn = _STORED_KINDS[k.dtype], _stored(k)[0]
        s = np.empty((1, Hkv, Hq // Hkv, k.shape[2]), np.float32)
        for h in range(Hkv):  # a head's rows are contiguous in the shard's buffer, its heads are not
            kernel.keys_pass(qn[0, h], np.ascontiguousarray(kn[h]), kind, np.float32(scale), s[0, h])
    else:
        kn = np.asarray(k.astype(mx.float32))
        s = (qn * scale) @ kn.swapaxes(-1, -2)  # [B, Hkv, groups, Lk]
    if not visible.all():
        s = np.where(visible, s, _NEG_INF)
    m = s.max(axis=-1, keepdims=True)
    p = _exp_shifted(np, s, m)
    denom = p.sum(axis=-1, keepdims=True)
    if kernel is not None:
        out, vn = np.empty((1, Hkv, Hq // Hkv, Dv), np.float32), _stored(v)[0]
        for h in range(Hkv):
            kernel.values_pass(p[0, h], np.ascontiguousarray(vn[h]), kind, out[0, h])
    else:
        out = p @ np.asarray(v.astype(mx.float32))
    out, lse = out / denom, m + np.log(denom)
    return mx.array(out.reshape(B, Hq, 1, Dv)), mx.array(lse.reshape(B, Hq, 1))


# K/V the kernels read as stored (one_query_kernel's BFLOAT16, FLOAT16); float32 ones go to numpy's
# BLAS as they are, about as fast, and a float32 model's rank need not load numba (70 MB)
_STORED_KINDS = {mx.bfloat16: 1, mx.float16: 2}


def _stored(x: mx.array) -> np.ndarray:
    """A view of x's stored bytes (16-bit floats as uint16)."""
    return np.asarray(x.view(mx.uint16))


@functools.cache
def one_query_kernel() -> ModuleType | None:
    """The compiled kernels (cpchat.core.one_query_kernel), or None where numba cannot run."""
    try:
        from cpchat.core import one_query_kernel as kernel

        q, s = np.ones((1, 4), np.float32), np.empty((1, 2), np.float32)
        for kind in (kernel.BFLOAT16, kernel.FLOAT16):
            kv = np.ones((2, 4), np.uint16)
            kernel.keys_pass(q, kv, kind, np.float32(1), s)
            kernel.values_pass(s, kv, kind, np.empty((1, 4), np.float32))
        return kernel
    except Exception:  # noqa: BLE001 (no numba, or it cannot compile here: numpy's way)
        return None


def attention_over_blocks(q: mx.array, blocks: list[tuple[mx.array, mx.array, np.ndarray]],
                          q_pos: np.ndarray, scale: float, window: int | None = None
                          ) -> tuple[mx.array, mx.array]:
    """Attention of a few queries (a decode step's) over several blocks of keys, as `partial_attention`
    over them all would give it, in one lazy MLX graph: one softmax over every block's scores, with no
    tiles and no merge. On the CPU each MLX operation has a fixed cost and MLX's `exp` is slow, so a
    tiled pass a block and a merge cost twice this (SmolLM2, 2K keys in 3 blocks: 2.85 ms a layer
    against 1.50). Every query must see a key (its own)."""
    B, Hq, Lq, D = q.shape
    qp = _positions(q_pos, Lq, "q_pos")
    scaled = q.astype(mx.float32) * scale
    scores, values = [], []
    for k, v, k_pos in blocks:
        _check_shapes(q, k, v)
        kp = _positions(k_pos, k.shape[2], "k_pos")
        visible = None
        if len(kp) and (kp.max() > qp.min() or (window is not None and qp.max() - kp.min() >= window)):
            visible = _visible(np, qp, kp, window)
            if not visible.any():
                continue
        Hkv = k.shape[1]
        s = scaled.reshape(B, Hkv, Hq // Hkv * Lq, D) @ k.astype(mx.float32).swapaxes(-1, -2)
        if visible is not None:  # rows are (query head, query) pairs, heads outer
            s = mx.where(mx.array(np.tile(visible, (Hq // Hkv, 1))), s, _NEG_INF)
        scores.append(s)
        values.append(v.astype(mx.float32))
    if not scores:
        raise ValueError("attention_over_blocks: a query sees no key")
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    m = s.max(axis=-1, keepdims=True)
    p = mx.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    out, start = None, 0
    for v in values:
        part = p[..., start:start + v.shape[2]] @ v
        out = part if out is None else out + part
        start += v.shape[2]
    return (out / denom).reshape(B, Hq, Lq, -1), (m + mx.log(denom)).reshape(B, Hq, Lq)


def _visible(xp: ModuleType, q_pos: np.ndarray, k_pos: np.ndarray, window: int | None):
    """Which (query, key) pairs may attend, made where the scores are (a mask made on the host
    and copied to a GPU cost more than the attention it masked: 1.7 of 2.8 s at 16K)."""
    if xp is mx:
        q_pos, k_pos = mx.array(q_pos.astype(np.int32)), mx.array(k_pos.astype(np.int32))
    delta = q_pos[:, None] - k_pos[None, :]
    return (delta >= 0) if window is None else (delta >= 0) & (delta < window)


def fused_attention(q: mx.array, k: mx.array, v: mx.array, q_pos: np.ndarray, k_pos: np.ndarray,
                    scale: float, window: int | None = None, sinks: mx.array | None = None,
                    tile: int = TILE) -> mx.array:
    """Attention of q over every key (and the sinks) through MLX's fused kernel, the one mlx-lm runs,
    in q's dtype: for a rank that holds all the keys and so needs no log-sum-exp to merge (one rank)
    on a GPU, where the tiles' separate operations cost several times more. Every query must see a
    key (its own). Queries go in tiles of `tile`, each with a mask where some pair is not visible."""
    qp, kp = _positions(q_pos, q.shape[2], "q_pos"), _positions(k_pos, k.shape[2], "k_pos")
    outs = []
    for q0 in range(0, len(qp), tile):
        tile_pos = qp[q0:q0 + tile]
        seen = kp <= tile_pos.max()  # keys in every query's future are not read at all
        if window is not None:
            seen &= kp > tile_pos.min() - window
        keys, values, k_seen = k, v, kp
        if not seen.all():
            index = mx.array(np.flatnonzero(seen).astype(np.int32))
            keys, values, k_seen = mx.take(k, index, axis=2), mx.take(v, index, axis=2), kp[seen]
        whole = k_seen.max() <= tile_pos.min() and (window is None or tile_pos.max() - k_seen.min() < window)
        mask = None if whole else _visible(mx, tile_pos, k_seen, window)
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, q0:q0 + tile], keys, values, scale=scale,
                                                         mask=mask, sinks=sinks))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def tile_bounds(positions: np.ndarray, tile: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of at most `tile` positions each, cut at every break in the
    positions between runs of at least MIN_RUN."""
    breaks = (np.flatnonzero(np.diff(positions) != 1) + 1).tolist()
    runs: list[list[int]] = []
    for a, b in zip([0, *breaks], [*breaks, len(positions)], strict=True):
        if runs and (b - a < MIN_RUN or runs[-1][1] - runs[-1][0] < MIN_RUN):
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(s, min(s + tile, b)) for a, b in runs for s in range(a, b, tile)]


def _query_tile(xp: ModuleType, qt, kt, vf, qt_pos: np.ndarray, kp: np.ndarray, k_tile: int,
                window: int | None):
    """Online softmax of one query tile [B, Hkv, R, D] over the key tiles it can see."""
    q_lo, q_hi = int(qt_pos.min()), int(qt_pos.max())
    rows = qt.shape[:3]
    m = xp.full(rows, _NEG_INF, dtype=xp.float32)
    denom = xp.zeros(rows, dtype=xp.float32)
    acc = xp.zeros((*rows, vf.shape[-1]), dtype=xp.float32)
    for k0, k1 in tile_bounds(kp, k_tile):
        k_lo, k_hi = int(kp[k0:k1].min()), int(kp[k0:k1].max())
        if k_lo > q_hi or (window is not None and q_lo - k_hi >= window):
            continue  # every key in the future of every query, or out of every query's window
        s = _scores(xp, qt, kt[..., k0:k1])
        if k_hi > q_lo or (window is not None and q_hi - k_lo >= window):  # some pair is masked
            s = xp.where(_visible(xp, qt_pos, kp[k0:k1], window), s, _NEG_INF)
        m_new = xp.maximum(m, s.max(axis=-1))
        m_safe = xp.where(m_new == _NEG_INF, 0.0, m_new)
        p = _exp_shifted(xp, s, m_safe[..., None])
        alpha = xp.exp(m - m_safe)
        denom = alpha * denom + p.sum(axis=-1)
        acc = alpha[..., None] * acc + p @ vf[:, :, k0:k1]
        m = m_new
    seen = denom > 0
    out = acc / xp.where(seen, denom, 1.0)[..., None]
    lse = xp.where(seen, m + xp.log(xp.where(seen, denom, 1.0)), _NEG_INF)
    return out, lse


def _scores(xp: ModuleType, qt, kt):
    """qt @ kt. In numpy with kt a transposed view of the stored keys (few queries, as in
    decode), (K @ qt^T)^T is the faster product: 88-96 vs 95-98 ms a decode token at 4K."""
    if xp is np and kt.strides[-1] != kt.itemsize:
        return np.ascontiguousarray((kt.swapaxes(-1, -2) @ qt.swapaxes(-1, -2)).swapaxes(-1, -2))
    return qt @ kt


def _exp_shifted(xp: ModuleType, s, shift):
    """exp(s - shift); numpy works in place on the score block (no 2 new blocks of tile x tile)."""
    if xp is np:
        s -= shift
        return np.exp(s, out=s)
    return mx.exp(s - shift)


def merge_partials(parts: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """Merge partial attentions over disjoint key sets into the full attention."""
    if not parts:
        raise ValueError("merge_partials needs at least one partial")
    out_shape, dtype = parts[0][0].shape, parts[0][0].dtype
    for out, lse in parts:
        if out.shape != out_shape or lse.shape != out_shape[:-1]:
            raise ValueError(f"partials disagree in shape: {out.shape}/{lse.shape} vs {out_shape}")
    if len(parts) == 1:
        return parts[0]
    lses = mx.stack([lse.astype(mx.float32) for _, lse in parts])
    m = lses.max(axis=0)
    m_safe = mx.where(m == _NEG_INF, 0.0, m)
    weights = mx.exp(lses - m_safe)
    total = weights.sum(axis=0)
    seen = total > 0
    out = sum(w[..., None] * o.astype(mx.float32) for w, (o, _) in zip(weights, parts))
    out = out / mx.where(seen, total, 1.0)[..., None]
    lse = mx.where(seen, m_safe + mx.log(mx.where(seen, total, 1.0)), _NEG_INF)
    return out.astype(dtype), lse


def add_sink(out: mx.array, lse: mx.array, sinks: mx.array) -> mx.array:
    """Attention over every key plus one sink per head (a logit with a zero value): the merged
    output [B, H, L, Dv] rescaled by exp(lse - logaddexp(lse, sink)). Call it once, after the merge."""
    sink = sinks.astype(mx.float32)[None, :, None]
    return out * mx.exp(lse - mx.logaddexp(lse, sink))[..., None]
