"""The ring algorithms, one module each: how a layer's attention crosses the ring in a prefill
(`pass_kv`, `pass_q`, `all_gather`, `ulysses`) and in a decode step (`decode`).

Each is a function `(rp, call, q, k, v, k_pos) -> (out, lse)` (context_parallel.Attend): this rank's
queries and its own K/V shard in, the attention of those queries over every rank's keys out (out
[1, H, L, Dv] float32, lse [1, H, L]). ATTEND maps each name of cpchat.core.algorithms.REGISTRY to
its function; a RingPass is given the one it runs."""

from __future__ import annotations

from cpchat.core.algorithms import BY_NAME, REGISTRY
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.algorithms import all_gather, decode, pass_kv, pass_q, ulysses
from cpchat.rank.context_parallel import Attend

ATTEND: dict[str, Attend] = {
    "pass_kv": pass_kv.attend,
    "pass_q": pass_q.attend,
    "all_gather": all_gather.attend,
    "ulysses": ulysses.attend,
    "exchange": decode.exchange,
    "ring": decode.ring,
    "lead": decode.lead,
    "gather": decode.gather,
}
assert set(ATTEND) == set(BY_NAME), "every algorithm of the registry has its function here"

# The wire's values of GenerateRequest.algorithm and .decode; an unset one means pass-KV, and the
# one-step exchange.
PREFILL = {pb.ALGORITHM_UNSPECIFIED: BY_NAME["pass_kv"]} | {
    pb.Algorithm.Value(a.wire): a for a in REGISTRY if a.stage == "prefill"}
DECODE = {pb.DECODE_UNSPECIFIED: BY_NAME["exchange"]} | {
    pb.Decode.Value(a.wire): a for a in REGISTRY if a.stage == "decode"}
