"""pass-Q: K/V stay; each rank's queries travel a full lap of the ring (N hops).

The queries carry their running (out, lse): each rank merges its own partial into it
(cpchat.core.attention.merge_partials), and the queries come home with every rank's merged in."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.attention import merge_partials
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass


def attend(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    n, layer = rp.ring.size, call.layer
    timing = rp.step_timing(layer, 0)
    out, lse = rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)
    if n == 1:
        return out, lse
    q_pos = mx.array(rp.q_positions)
    rp.send(timing, rp.key(layer, 0, pb.QUERY), [q, q_pos, out, lse])
    for step in range(1, n + 1):
        timing = rp.step_timing(layer, step)
        vq, vq_pos, vout, vlse = rp.take(timing, rp.key(layer, step - 1, pb.QUERY))
        if step == n:
            return vout, vlse  # our own queries, home with every rank's partial merged
        mine = rp.partial(call, timing, vq, np.asarray(vq_pos), k, v, k_pos)
        vout, vlse = merge_partials([(vout, vlse), mine])
        rp.send(timing, rp.key(layer, step, pb.QUERY), [vq, vq_pos, vout, vlse])
    raise AssertionError("unreachable")
