"""A decode step's exchange: every rank holds the same one query and its own share of the keys.

Each rank computes its partial output (cpchat.core.attention.partial_attention) and the N partials
are merged in rank order on every rank (merge_partials), so all ranks agree bit for bit and go on
with the same token. `exchange` sends them to every rank at once (one step), `ring` around the
ring (N-1 hops). A partial travels as one tensor, its lse a last column of its output: one frame,
one message and one wake-up a hop, where a step's latency is what a user waits for.

`lead` is for ranks that share one machine's cores, where each rank's copy of a step's weight
products only takes cores from the others: rank 0 alone runs the model and sends each layer's
query to the other ranks (with the new token's keys and values to the one that keeps them), which
`follow`: they attend the query over their keys and send their partials back, to be merged on rank 0.

`gather` is for ranks that share one machine's memory too: rank 0 holds every other rank's keys for
the answer (cpchat.rank.gathered) and attends over them and its own as one rank alone does; nothing
crosses per layer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cpchat.core.attention import merge_partials
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.context_parallel import LayerCall, Partial, RingPass


def exchange(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
             k_pos: np.ndarray) -> Partial:
    """Every rank sends its partial output to every other rank at once."""
    layer, key = call.layer, rp.key(call.layer, 0, pb.PARTIAL)
    timing = rp.step_timing(layer, 0)
    mine = rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)
    if rp.ring.size == 1:
        return mine
    rp.send(timing, key, [packed(mine)], to=rp.ring.peers)
    timing = rp.step_timing(layer, 1)
    parts = [mine if r == rp.ring.rank else unpacked(rp.take(timing, key, r)) for r in range(rp.ring.size)]
    return merge_partials(parts)


def ring(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
         k_pos: np.ndarray) -> Partial:
    """Partial outputs travel the ring (N-1 hops), each rank keeping every one that passes."""
    n, layer = rp.ring.size, call.layer
    timing = rp.step_timing(layer, 0)
    parts = {rp.ring.rank: rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)}
    block = [packed(parts[rp.ring.rank])]
    for step in range(n - 1):
        rp.send(timing, rp.key(layer, step, pb.PARTIAL), block)
        timing = rp.step_timing(layer, step + 1)
        block = rp.take(timing, rp.key(layer, step, pb.PARTIAL))
        parts[(rp.ring.rank - step - 1) % n] = unpacked(block)
    return merge_partials([parts[r] for r in range(n)])


def lead(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
         k_pos: np.ndarray) -> Partial:
    """Rank 0's part of a lead step: the query out, its own partial, every other rank's back."""
    n, layer = rp.ring.size, call.layer
    timing = rp.step_timing(layer, 0)
    if n > 1:
        keeper, new = rp.keeper, rp.unkept.get(layer, ())
        mx.eval(q, *new)
        for r in rp.ring.peers:
            rp.send(timing, rp.key(layer, 0, pb.QUERY), [q, *new] if r == keeper else [q], to=[r])
    mine = rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)
    if n == 1:
        return mine
    timing = rp.step_timing(layer, 1)
    return merge_partials([mine if r == 0 else unpacked(rp.take(timing, rp.key(layer, 0, pb.PARTIAL), r))
                           for r in range(n)])


def follow(rp: RingPass, calls: list[LayerCall]) -> None:
    """Another rank's part of a lead step, layer by layer: rank 0's query (and the new token's keys
    and values, if this rank keeps them) in, its partial over this rank's keys out."""
    for call in calls:
        timing = rp.step_timing(call.layer, 0)
        q, *new = rp.take(timing, rp.key(call.layer, 0, pb.QUERY), 0)
        if new:
            rp.store_new(call.layer, *new)
        k, v, k_pos = rp.kv.layer(call.layer)
        mine = rp.partial(call, timing, q, rp.q_positions, k, v, k_pos)
        rp.send(timing, rp.key(call.layer, 0, pb.PARTIAL), [packed(mine)], to=[0])


def gather(rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
           k_pos: np.ndarray) -> Partial:
    """Rank 0's attention in a gather step (a ring of one): over its own shard and the other ranks'
    (`rp.held`) and the answer's new tokens (`k`, `v`), as one rank holding them all attends."""
    return rp.attend_blocks(call, q, rp.q_positions, [*rp.held.get(call.layer, []), (k, v, k_pos)])


def packed(partial: Partial) -> mx.array:
    """out [B, H, 1, Dv] and lse [B, H, 1] as one [B, H, 1, Dv + 1] float32 tensor, joined in numpy:
    the partial is evaluated already, and evaluating even a small MLX operation costs ~0.14 ms on the
    CPU, on the critical path of every layer's exchange."""
    out, lse = partial
    return mx.array(np.concatenate([np.asarray(out), np.asarray(lse)[..., None]], axis=-1))


def unpacked(block: list[mx.array]) -> Partial:
    (packed,) = block
    return packed[..., :-1], packed[..., -1]
