"""Ulysses: an all-to-all from "every head, this rank's tokens" to "every token, this rank's heads".

Each rank attends its share of the query heads over the whole sequence (cached keys included) in
one pass, and a second all-to-all brings each output home: no merge, the heads are disjoint. Query
heads are split in the ranks' shares, as near as whole heads allow (cpchat.core.sharding.head_split),
so a slower rank attends fewer heads as it runs fewer tokens through the weights; a key head whose
query heads fall on two ranks goes to both. With more ranks than query heads, some ranks get none."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import KV, apply, concatenate, take
from cpchat.core.sharding import head_split
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass, kv_block


def attend(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    n, me, layer = rp.ring.size, rp.ring.rank, call.layer
    shares = head_split(q.shape[1], call.kv_heads, n, rp.shares)
    timing = rp.step_timing(layer, 0)
    q_pos = mx.array(rp.q_positions)

    def heads_of(share) -> tuple[KV, KV, np.ndarray] | None:
        """This rank's keys and values of a share's key heads (None: it holds no keys)."""
        if k is None or len(k_pos) == 0:
            return None
        return _select_heads(k, share.kv_index), _select_heads(v, share.kv_index), k_pos

    for rank, share in enumerate(shares):
        if rank != me and share.stop > share.start:
            kv = heads_of(share) or (None, None, k_pos)
            block = [q[:, share.start:share.stop], q_pos, *kv_block(q, *kv)]
            rp.send(timing, rp.key(layer, 0, pb.HEADS), block, to=[rank])
    home = {}
    if shares[me].stop > shares[me].start:  # with more ranks than query heads, some have none
        timing = rp.step_timing(layer, 1)
        heads_key = rp.key(layer, 0, pb.HEADS)
        share = shares[me]
        queries = [(q[:, share.start:share.stop], rp.q_positions) if r == me else None for r in range(n)]
        keys = [heads_of(share) if r == me else None for r in range(n)]
        for r in rp.ring.peers:
            block = rp.take(timing, heads_key, r)
            queries[r] = block[0], np.asarray(block[1])
            keys[r] = rp.read_kv(block[2:])
        gq = mx.concatenate([b[0] for b in queries], axis=2)
        gq_pos = np.concatenate([b[1] for b in queries])
        with_keys = [b for b in keys if b is not None]
        gk, gv = (concatenate([b[i] for b in with_keys], axis=2) for i in (0, 1))
        gk_pos = np.concatenate([b[2] for b in with_keys])
        out, lse = rp.partial(call, timing, gq, gq_pos, gk, gv, gk_pos)
        bounds = np.cumsum([0, *(b[0].shape[2] for b in queries)]).tolist()
        home = {r: [a[:, :, bounds[r]:bounds[r + 1]] for a in (out, lse)] for r in range(n)}
        for r in rp.ring.peers:
            rp.send(timing, rp.key(layer, 0, pb.OUTPUT), home[r], to=[r])
    timing = rp.step_timing(layer, 2)
    parts = [home[me] if r == me else rp.take(timing, rp.key(layer, 0, pb.OUTPUT), r)
             for r, share in enumerate(shares) if share.stop > share.start]
    return mx.concatenate([o for o, _ in parts], axis=1), mx.concatenate([s for _, s in parts], axis=1)


def _select_heads(x: KV, index: range | list[int]) -> KV:
    """The key (or value) heads of `index`."""
    if not isinstance(index, range):
        return take(x, mx.array(index), axis=1)
    return apply(x, lambda a: a[:, index.start:index.stop])
