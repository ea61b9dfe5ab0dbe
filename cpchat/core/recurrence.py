"""A linear recurrence cut into chunks, run in parallel and joined exactly.

Gated DeltaNet and Mamba-2 carry a state S (per head, [Dv, Dk]) through the
sequence, and each token acts on it affinely:

    Gated DeltaNet:  S_t = S_{t-1} A_t + B_t,   A_t = g_t (I - b_t k_t k_t^T),   B_t = b_t v_t k_t^T
    Mamba-2:         S_t = S_{t-1} A_t + B_t,   A_t = exp(dt_t a) I,              B_t = dt_t x_t B_t^T
    output:          y_t = S_t q_t   (Mamba-2: q_t is C_t, plus the skip D x_t)

So a chunk of tokens t = 1..T acts on the state it starts from as

    S_end = S_start P + Q,        P = A_1 ... A_T
    y_t   = y0_t + S_start r_t,   r_t = A_1 ... A_t q_t

where Q and y0 come from running the chunk from a zero state, and P and r from
running it with zero inputs (v = 0, x = 0) from the identity state I [Dk, Dk]:
then S_t = A_1 ... A_t and y_t = r_t. Each row of the state evolves on its own,
from its own row of the input (A_t acts from the right), so one run does both:
from the stacked state [0; I] [Dv + Dk, Dk] with the inputs [v; 0], it returns
[y0; r] and the state [Q; P]. The run is the model's own recurrence function
(or a faster one with the same results), so nothing of a family's gate or
update rule is written here.

Every rank runs its chunks in parallel; the chunks' (P, Q) are
all-gathered and folded in sequence order from the state the conversation
held (`fold`), which gives each chunk its S_start and the final state; each
rank then adds S_start r_t to its outputs (`add_start_state`). A chunk that
starts from no state (the first of a conversation) needs neither P nor r.
"""

from __future__ import annotations

import mlx.core as mx


def stacked_start(heads: int, dv: int, dk: int) -> mx.array:
    """[1, heads, dv + dk, dk]: zeros over the identity, the start state whose run returns [y0; r] and
    [Q; P] when the inputs are [v; 0]."""
    start = mx.concatenate([mx.zeros((dv, dk), mx.float32), mx.eye(dk, dtype=mx.float32)])
    return mx.broadcast_to(start, (1, heads, dv + dk, dk))


def fold(start: mx.array | None, transforms: list[tuple[mx.array | None, mx.array]]
         ) -> tuple[list[mx.array | None], mx.array | None]:
    """Each chunk's start state and the state after the last, from chunks' (P, Q) in sequence order
    (P None: the chunk's start state is known to be zero, so it was not computed)."""
    starts, state = [], start
    for p, q in transforms:
        starts.append(state)
        if state is None:
            state = q
        else:
            assert p is not None, "a chunk after a nonzero state needs its P"
            state = state @ p + q
    return starts, state


def add_start_state(y0: mx.array, r: mx.array, start: mx.array) -> mx.array:
    """y0_t + S_start r_t, for y0 [B, T, H, Dv], r [B, T, H, Dk] and S_start [B, H, Dv, Dk]."""
    correction = r.transpose(0, 2, 1, 3) @ start.swapaxes(-1, -2)  # [B, H, T, Dv]
    return y0 + correction.transpose(0, 2, 1, 3)
