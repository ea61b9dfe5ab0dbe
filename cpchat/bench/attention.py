"""Micro-benchmark: one full causal pass of `partial_attention` against the fused
`mx.fast.scaled_dot_product_attention`, same inputs, in the same process."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from cpchat.core.attention import partial_attention


def time_attention(length: int, heads: int = 8, kv_heads: int = 8, dim: int = 64, repeats: int = 2) -> dict:
    q = mx.random.normal((1, heads, length, dim), key=mx.random.key(0))
    k = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(1))
    v = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(2))
    mx.eval(q, k, v)
    pos = np.arange(length)
    scale = dim**-0.5

    def best(fn) -> tuple[float, mx.array]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            mx.eval(out)
            times.append(time.perf_counter() - t0)
        return min(times), out

    fused_s, fused = best(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))
    tiled_s, (tiled, _) = best(lambda: partial_attention(q, k, v, pos, pos, scale))
    return {
        "length": length,
        "fused_s": fused_s,
        "tiled_s": tiled_s,
        "ratio": tiled_s / fused_s,
        "max_abs_error": mx.abs(tiled - fused).max().item(),
    }
