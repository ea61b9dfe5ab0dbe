"""All-gather: queries stay; every rank sends its K/V to every other rank at once.

A rank attends to its own block while the others arrive, then to all of theirs in one pass, and
merges the two partials (cpchat.core.attention.merge_partials). The others' K/V is dropped when the
layer ends: the store stays 1/N of the sequence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.attention import merge_partials
from cpchat.core.quantized_kv import concatenate
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass, kv_block


def attend(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    layer, key = call.layer, rp.key(call.layer, 0, pb.GATHER)
    timing = rp.step_timing(layer, 0)
    rp.send(timing, key, kv_block(q, k, v, k_pos), to=rp.ring.peers)
    parts = [rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)]
    timing = rp.step_timing(layer, 1)
    blocks = [rp.take_kv(timing, key, source) for source in rp.ring.peers]
    blocks = [b for b in blocks if b is not None]
    if blocks:
        gk, gv = (concatenate([b[i] for b in blocks], axis=2) for i in (0, 1))
        g_pos = np.concatenate([b[2] for b in blocks])
        parts.append(rp.partial(call, timing, q, rp.q_positions, gk, gv, g_pos))
    return merge_partials(parts)
