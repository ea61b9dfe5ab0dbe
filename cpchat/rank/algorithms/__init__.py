"""The ring algorithms, one module each: how a layer's attention crosses the ring in a prefill
(`pass_kv`, `pass_q`, `all_gather`, `ulysses`) and in a decode step (`decode`).

Each is a function `(rp, call, q, k, v, k_pos) -> (out, lse)`: this rank's queries and its own
K/V shard in, the attention of those queries over every rank's keys out (out [1, H, L, Dv] float32,
lse [1, H, L]). Which function runs is read from cpchat.core.algorithms.REGISTRY, the one list of
the algorithms' names, wire values and functions."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np

from cpchat.core.algorithms import BY_NAME, REGISTRY, Algorithm
from cpchat.protocol import cpchat_pb2 as pb

if TYPE_CHECKING:
    from cpchat.rank.context_parallel import LayerCall, Partial, RingPass

# The wire's values of GenerateRequest.algorithm and .decode; an unset one means pass-KV, and the
# one-step exchange.
PREFILL = {pb.ALGORITHM_UNSPECIFIED: BY_NAME["pass_kv"]} | {
    pb.Algorithm.Value(a.wire): a for a in REGISTRY if a.stage == "prefill"}
DECODE = {pb.DECODE_UNSPECIFIED: BY_NAME["exchange"]} | {
    pb.Decode.Value(a.wire): a for a in REGISTRY if a.stage == "decode"}


class Attend(Protocol):
    def __call__(self, rp: RingPass, call: LayerCall, q: mx.array, k: mx.array | None, v: mx.array | None,
                 k_pos: np.ndarray) -> Partial: ...


@functools.cache
def attend_function(algorithm: Algorithm) -> Attend:
    """The function `algorithm.function` names ("pass_kv:attend"), from its module here."""
    module, _, name = algorithm.function.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
