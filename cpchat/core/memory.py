"""What a prefill needs in memory on each rank, known before it runs.

A rank that runs a prefill of T new tokens over N ranks holds T_r of them (padded(T)/N for equal
shares; cpchat.core.sharding). Its forward allocates, beyond what the rank held before, the new
tokens' keys and values, T_r k L bytes (k a token's in one layer, packed with --kv-bits once the
conversation passes the quantized start), and the activations of its block: F(T_r) = fixed +
per_token · T_r, a line the rank measures when the model loads (`ForwardMemory`: MLX's peak over two
forwards, less the K/V they stored). On top of that:

    tiles   attention's score block and its masked copy, 2 · 4 · Hkv · (G tq) · min(k_tile, keys) bytes
            (numpy's, on a CPU: MLX does not count them), G = Hq/Hkv, tq = min(TILE, T_r), k_tile as in
            cpchat.core.attention
    ring    the blocks one layer has in flight on the rank (k = K/V bytes per token and layer):
              pass-KV     3 T_r k                 the block in use, the next one, the one sent
              all-gather  N T_r k                 every rank's block of the layer
              pass-Q      3 T_r Hq (D + Dv + 1) 4 queries and running outputs, in and out
              Ulysses     2 T Hq (D + 2 Dv)/N 4   the rank's heads of every token, in and out
    answer  the K/V of the answer's tokens the rank keeps: its share of max_tokens · k · L

The need is their sum; a rank fits when the need is at most the memory it reports free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpchat.core.attention import TILE
from cpchat.core.heuristics import Workload
from cpchat.core.sharding import Shares, chunk_lengths, rank_tokens


@dataclass(frozen=True)
class ForwardMemory:
    """Bytes a forward of T tokens allocates on a rank beyond what it held before and the K/V it
    stores, as measured."""

    fixed_bytes: float
    per_token_bytes: float

    def bytes(self, tokens: int) -> float:
        return self.fixed_bytes + self.per_token_bytes * tokens


@dataclass(frozen=True)
class Need:
    """One rank's memory for one prefill, against what it has free."""

    rank: int
    kv_bytes: float  # the new tokens' keys and values
    forward_bytes: float  # the activations of the rank's block (measured line)
    tiles_bytes: float
    ring_bytes: float
    answer_bytes: float
    free_bytes: int
    draft_bytes: float = 0.0  # a draft model's K/V of the conversation and answer (on the sampling rank)

    @property
    def total(self) -> float:
        return (self.kv_bytes + self.forward_bytes + self.tiles_bytes + self.ring_bytes + self.answer_bytes
                + self.draft_bytes)

    @property
    def fits(self) -> bool:
        return self.total <= self.free_bytes


def tokens_per_rank(new_tokens: int, ranks: int, shares: Shares | None = None) -> list[int]:
    """The tokens each rank's prefill forward runs (head-tail sharding pads its two chunks)."""
    return [2 * c for c in chunk_lengths(new_tokens, ranks, shares)]


def kv_bytes_per_token(w: Workload, layers: int = 0, packed: bool | None = None) -> float:
    """Keys and values of one token, in `layers` attention layers (all of them if 0), as held: packed
    when the format quantizes (or as `packed` says)."""
    packed = w.kv_format.quantized if packed is None else packed
    element = w.kv_format.bytes_per_element(w.bytes_per_element) if packed else w.bytes_per_element
    return (layers or w.layers) * w.kv_heads * (w.head_dim + w.value_dim) * element


def gather_bytes(w: Workload, cached_tokens: int, answer_tokens: int) -> float:
    """What rank 0 holds for a gather decode besides its own shard: the other ranks' K/V, as they
    sent them, and the answer's."""
    others = cached_tokens - rank_tokens(cached_tokens, w.ranks, w.shares)[0]
    return kv_bytes_per_token(w) * (others + answer_tokens)


def tile_bytes(w: Workload, tokens: int) -> float:
    groups = w.q_heads // w.kv_heads
    tq = min(TILE, tokens)
    k_tile = max(TILE, TILE * TILE // (groups * tq))
    keys = w.cached_tokens + w.new_tokens
    return 2 * 4 * w.kv_heads * groups * tq * min(k_tile, keys)


def ring_bytes(w: Workload, algorithm: str, tokens: int) -> float:
    n = w.ranks
    if n == 1:
        return 0.0
    layer_kv = kv_bytes_per_token(w, layers=1)
    return {
        "pass_kv": 3 * tokens * layer_kv,
        "all_gather": n * tokens * layer_kv,
        "pass_q": 3 * tokens * w.q_heads * (w.head_dim + w.value_dim + 1) * 4,
        "ulysses": 2 * w.new_tokens * w.q_heads * (w.head_dim + 2 * w.value_dim) / n * 4,
    }.get(algorithm, 0.0)


def prefill_needs(w: Workload, algorithm: str, forward: list[ForwardMemory], free: list[int],
                  answer_tokens: int = 0, draft_bytes: float = 0.0) -> list[Need]:
    """Each rank's need for this prefill (and its answer's K/V), beside what it reports free; the first
    rank also holds `draft_bytes` more (a draft model's K/V: it samples)."""
    shares = w.shares or (1,) * w.ranks
    packed = w.kv_format.quantized and w.cached_tokens + w.new_tokens > w.kv_format.start
    needs = []
    for r, tokens in enumerate(tokens_per_rank(w.new_tokens, w.ranks, w.shares)):
        answer = math.ceil(answer_tokens * shares[r] / sum(shares)) * kv_bytes_per_token(w)
        needs.append(Need(r, tokens * kv_bytes_per_token(w, packed=packed), forward[r].bytes(tokens),
                          tile_bytes(w, tokens), ring_bytes(w, algorithm, tokens), answer, free[r],
                          0.0 if r else draft_bytes))
    return needs
