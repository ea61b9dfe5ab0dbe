"""Partial causal attention with its log-sum-exp, and the exact merge of partials.

For one query row q and a set of keys K with values V,

    s_j = scale * q . k_j          (only keys with k_pos <= q_pos)
    lse = log sum_j exp(s_j)
    out = sum_j exp(s_j - lse) v_j

Two partials over disjoint key sets merge exactly:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

A row that saw no key has lse = -inf and out = 0, and contributes nothing.
Attention is computed in (query tile x key tile) blocks with an online softmax,
so memory stays bounded; tiles wholly in the future are skipped and wholly
visible tiles need no mask.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

TILE = 1024
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
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
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
    tile: int = TILE,
) -> tuple[mx.array, mx.array]:
    """Causal attention of q over (k, v) where key j is visible to query i iff
    q_pos[i] >= k_pos[j]. Returns out [B, Hq, Lq, D] in q's dtype and
    lse [B, Hq, Lq] in float32 (-inf, with out = 0, for rows that see no key)."""
    _check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    qp = _positions(q_pos, Lq, "q_pos")
    kp = _positions(k_pos, Lk, "k_pos")

    # Grouped-query attention: fold each KV head's G query heads into the row axis.
    qg = q.astype(mx.float32).reshape(B, Hkv, groups, Lq, D)
    kf, vf = k.astype(mx.float32), v.astype(mx.float32)
    kp_dev = mx.array(kp)

    outs, lses = [], []
    for q0 in range(0, Lq, tile):
        q1 = min(q0 + tile, Lq)
        tq = q1 - q0
        q_lo, q_hi = int(qp[q0:q1].min()), int(qp[q0:q1].max())
        qt = (qg[:, :, :, q0:q1] * scale).reshape(B, Hkv, groups * tq, D)
        qt_pos = mx.array(np.tile(qp[q0:q1], groups))[:, None]
        m = mx.full((B, Hkv, groups * tq), _NEG_INF)
        denom = mx.zeros((B, Hkv, groups * tq))
        acc = mx.zeros((B, Hkv, groups * tq, D))
        # Bound the score block to about tile x tile per KV head: few queries (decode) get long key tiles.
        k_tile = max(tile, tile * tile // (groups * tq))
        for k0 in range(0, Lk, k_tile):
            k1 = min(k0 + k_tile, Lk)
            k_lo, k_hi = int(kp[k0:k1].min()), int(kp[k0:k1].max())
            if k_lo > q_hi:
                continue  # every key in the future of every query
            s = qt @ kf[:, :, k0:k1].swapaxes(-1, -2)
            if k_hi > q_lo:  # some pair is masked
                s = mx.where(qt_pos >= kp_dev[None, k0:k1], s, _NEG_INF)
            m_new = mx.maximum(m, s.max(axis=-1))
            m_safe = mx.where(m_new == _NEG_INF, 0.0, m_new)
            p = mx.exp(s - m_safe[..., None])
            alpha = mx.exp(m - m_safe)
            denom = alpha * denom + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vf[:, :, k0:k1]
            m = m_new
        seen = denom > 0
        out = acc / mx.where(seen, denom, 1.0)[..., None]
        lse = mx.where(seen, m + mx.log(mx.where(seen, denom, 1.0)), _NEG_INF)
        out = out.reshape(B, Hkv, groups, tq, D)
        lse = lse.reshape(B, Hkv, groups, tq)
        if Lq > tile:
            mx.eval(out, lse)  # bound memory: one query tile's graph at a time
        outs.append(out)
        lses.append(lse)

    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=3)
    return out.reshape(B, Hq, Lq, D).astype(q.dtype), lse.reshape(B, Hq, Lq)


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
