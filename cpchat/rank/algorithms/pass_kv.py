"""pass-KV: queries stay; every rank's K/V block visits every rank (N-1 hops).

Each rank forwards the block it holds before it attends to it, so the send overlaps the compute;
the N partials (one per block, cpchat.core.attention.partial_attention) merge exactly
(merge_partials). A rank that holds no keys of the layer sends an empty block."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.attention import merge_partials
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass, empty_partial, kv_block


def attend(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    n, layer = rp.ring.size, call.layer
    parts = []
    block = None if k is None or len(k_pos) == 0 else (k, v, k_pos)
    for step in range(n):
        timing = rp.step_timing(layer, step)
        if step > 0:
            block = rp.take_kv(timing, rp.key(layer, step - 1, pb.KV))
        if step < n - 1:
            rp.send(timing, rp.key(layer, step, pb.KV), kv_block(q, *(block or (None, None, k_pos[:0]))))
        if block is not None:
            parts.append(rp.partial(call, timing, q, rp.q_positions, *block))
    return merge_partials(parts) if parts else empty_partial(q, call.value_dim)
