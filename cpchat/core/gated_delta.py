"""The gated delta rule over a whole prompt, chunk by chunk (the WY / UT-transform form).

Per head, with state S [Dv, Dk], scalar gate g_t, write strength b_t (mlx-lm's beta):

    S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,        y_t = S_t q_t

mlx-lm runs this token by token on the CPU (and on CUDA): one small graph per
token and layer. Within a chunk of C tokens starting from S_0 it has a closed
form built from C x C products, so the loop runs over chunks instead.

Write the update as S_t = g_t S_{t-1} + u_t k_t^T with u_t = b_t (v_t - g_t S_{t-1} k_t),
and let G_t = g_1 ... g_t (in the chunk). Unrolled,

    S_t = G_t S_0 + sum_{i<=t} (G_t / G_i) u_i k_i^T

so the u_t satisfy a unit lower-triangular system (rows t, i < t):

    u_t + b_t sum_{i<t} (G_t / G_i) (k_t . k_i) u_i = b_t v_t - b_t G_t S_0 k_t
    (I + L) U = diag(b) V - diag(b G) K S_0^T,     L_ti = b_t (G_t / G_i) k_t . k_i
    U = U0 - W S_0^T,    U0 = T diag(b) V,   W = T diag(b G) K,   T = (I + L)^-1

and the outputs and the state after the chunk follow:

    Y   = diag(G) Q S_0^T + M U,        M_ti = (G_t / G_i) q_t . k_i   (i <= t)
    S_C = G_C S_0 + U^T diag(G_C / G) K

T, W, U0 and M depend on the chunk's tokens only, so every chunk's are computed
at once; the loop over chunks carries S with four matrix products a chunk. Gate
ratios are taken as exp of differences of cumulative log gates, all <= 1.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array | None = None, chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The same as mlx-lm's `gated_delta_ops` with a scalar gate and no mask: q, k [B, T, Hk, Dk],
    v [B, T, Hv, Dv], g and beta [B, T, Hv], state [B, Hv, Dv, Dk] or None (zeros);
    returns y [B, T, Hv, Dv] in q's dtype and the final state in float32."""
    b, length, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    n = -(-length // chunk)
    pad = n * chunk - length

    def blocks(x: mx.array, fill: float = 0.0) -> mx.array:  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = x.astype(mx.float32)
        if x.ndim == 4 and x.shape[2] != hv:
            x = mx.repeat(x, hv // x.shape[2], axis=2)
        if pad:  # tokens that leave the state as it is: g = 1, beta = 0, k = v = 0
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return x.transpose(0, 3, 1, 2, *range(4, x.ndim))

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    log_g = mx.cumsum(mx.log(blocks(g, 1.0)), axis=-1)  # [B, H, n, C]: log G_t
    bb = blocks(beta)

    causal = mx.tril(mx.ones((chunk, chunk), mx.bool_))
    ratio = mx.exp(mx.where(causal, log_g[..., :, None] - log_g[..., None, :], -mx.inf))  # G_t / G_i, i<=t
    strict = ratio * (1 - mx.eye(chunk))
    lower = bb[..., None] * strict * (kb @ kb.swapaxes(-1, -2))
    inverse = mx.linalg.tri_inv(mx.eye(chunk) + lower, upper=False, stream=mx.cpu)
    u0 = inverse @ (bb[..., None] * vb)  # [B, H, n, C, Dv]
    w = inverse @ ((bb * mx.exp(log_g))[..., None] * kb)  # [B, H, n, C, Dk]
    m = ratio * (qb @ kb.swapaxes(-1, -2))  # [B, H, n, C, C]
    q_decayed = mx.exp(log_g)[..., None] * qb
    k_decayed = mx.exp(log_g[..., -1:] - log_g)[..., None] * kb  # (G_C / G_t) k_t
    chunk_decay = mx.exp(log_g[..., -1])[..., None, None]  # [B, H, n, 1, 1]

    s = None if state is None else state.astype(mx.float32)
    ys = []
    for j in range(n):
        if s is None:
            u, y = u0[:, :, j], m[:, :, j] @ u0[:, :, j]
            s = u.swapaxes(-1, -2) @ k_decayed[:, :, j]
        else:
            st = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
            u = u0[:, :, j] - w[:, :, j] @ st
            y = q_decayed[:, :, j] @ st + m[:, :, j] @ u
            s = chunk_decay[:, :, j] * s + u.swapaxes(-1, -2) @ k_decayed[:, :, j]
        ys.append(y)
    y = mx.stack(ys, axis=2).reshape(b, hv, n * chunk, dv)[:, :, :length]
    return y.transpose(0, 2, 1, 3).astype(q.dtype), s
