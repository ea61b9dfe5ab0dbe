"""A decode step's attention (one query position) straight from the stored keys and values.

Keys and values are read once, in the 16-bit dtype the K/V shard keeps (bfloat16 or float16, widened
a few rows at a time), every query head of a KV head scored from the same key row: no float32 copy
of the shard, and none of MLX's per-operation costs. The softmax's exp stays numpy's
(vectorized; numba's is scalar here), between the kernel's two passes:

    s[h, j] = scale * q[h] . k[j]          (keys_pass)
    out[h]  = sum_j p[h, j] v[j]           (values_pass, p = exp(s - max) masked)
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpchat.core.half_floats import BFLOAT16, FLOAT16, widen  # noqa: F401 (the kinds callers pass)

_jit = nb.njit(fastmath=True, boundscheck=False, cache=True, nogil=True)

CHUNK = 64  # key rows widened at a time, into a scratch that stays in L1


@_jit
def _widen(src, out, kind):
    """Stored rows as float32, into `out` (the same shape): one sweep over the chunk."""
    widen(src.reshape(-1), out.reshape(-1), kind)


@_jit
def _scores(q, block, scale, scores, j0):
    for j in range(block.shape[0]):
        row = block[j]
        for g in range(q.shape[0]):
            acc = np.float32(0)
            qg = q[g]
            for d in range(q.shape[1]):
                acc += qg[d] * row[d]
            scores[g, j0 + j] = acc * scale


@_jit
def _weighted(p, block, out, j0):
    for g in range(p.shape[0]):
        o = out[g]
        for j in range(block.shape[0]):
            w = p[g, j0 + j]
            row = block[j]
            for d in range(block.shape[1]):
                o[d] += w * row[d]


@_jit
def keys_pass(q, k, kind, scale, scores):
    """scores[g, j] = scale * q[g] . k[j] for one KV head: q [G, D] float32, k [L, D] as stored."""
    rows = np.empty((CHUNK, q.shape[1]), np.float32)
    for j0 in range(0, k.shape[0], CHUNK):
        n = min(CHUNK, k.shape[0] - j0)
        _widen(k[j0:j0 + n], rows[:n], kind)
        _scores(q, rows[:n], scale, scores, j0)


@_jit
def values_pass(p, v, kind, out):
    """out[g] = sum_j p[g, j] v[j] for one KV head: p [G, L] float32, v [L, Dv] as stored."""
    rows = np.empty((CHUNK, v.shape[1]), np.float32)
    out[:] = 0
    for j0 in range(0, p.shape[1], CHUNK):
        n = min(CHUNK, p.shape[1] - j0)
        _widen(v[j0:j0 + n], rows[:n], kind)
        _weighted(p, rows[:n], out, j0)
