"""Ulysses: an all-to-all from "every head, this rank's tokens" to "every token, this rank's heads".

Each rank attends its share of the query heads over the whole sequence (cached keys included) in
one pass, and a second all-to-all brings each output home: no merge, the heads are disjoint. Query
heads are split as evenly as N allows (cpchat.core.sharding.head_split); a key head whose query
heads fall on two ranks goes to both. With more ranks than query heads, some ranks get none."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.sharding import head_split
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass, kv_block


def attend(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    n, me, layer = rp.ring.size, rp.ring.rank, call.layer
    shares = head_split(q.shape[1], call.kv_heads, n)
    timing = rp.step_timing(layer, 0)
    q_pos = mx.array(rp.q_positions)
    kv = kv_block(q, k, v, k_pos)
    for rank, share in enumerate(shares):
        block = [q[:, share.start:share.stop], q_pos, *_select_heads(kv, share.kv_index)]
        if rank == me:
            own = block
        elif share.stop > share.start:
            rp.send(timing, rp.key(layer, 0, pb.HEADS), block, to=[rank])
    home = {}
    if shares[me].stop > shares[me].start:  # with more ranks than query heads, some have none
        timing = rp.step_timing(layer, 1)
        heads_key = rp.key(layer, 0, pb.HEADS)
        blocks = [own if r == me else rp.take(timing, heads_key, r) for r in range(n)]
        gq = mx.concatenate([b[0] for b in blocks], axis=2)
        gq_pos = np.concatenate([np.asarray(b[1]) for b in blocks])
        with_keys = [b for b in blocks if b[4].size]
        gk, gv = (mx.concatenate([b[i] for b in with_keys], axis=2) for i in (2, 3))
        gk_pos = np.concatenate([np.asarray(b[4]) for b in with_keys])
        out, lse = rp.partial(call, timing, gq, gq_pos, gk, gv, gk_pos)
        bounds = np.cumsum([0, *(b[0].shape[2] for b in blocks)]).tolist()
        home = {r: [a[:, :, bounds[r]:bounds[r + 1]] for a in (out, lse)] for r in range(n)}
        for r in rp.ring.peers:
            rp.send(timing, rp.key(layer, 0, pb.OUTPUT), home[r], to=[r])
    timing = rp.step_timing(layer, 2)
    parts = [home[me] if r == me else rp.take(timing, rp.key(layer, 0, pb.OUTPUT), r)
             for r, share in enumerate(shares) if share.stop > share.start]
    return mx.concatenate([o for o, _ in parts], axis=1), mx.concatenate([s for _, s in parts], axis=1)


def _select_heads(kv: list[mx.array], index: range | list[int]) -> list[mx.array]:
    """The key and value heads of `index` from a block (all of an empty one)."""
    k, v, k_pos = kv
    if k.shape[2] == 0:
        return kv
    if isinstance(index, range):
        return [k[:, index.start:index.stop], v[:, index.start:index.stop], k_pos]
    index = mx.array(index)
    return [mx.take(k, index, axis=1), mx.take(v, index, axis=1), k_pos]
