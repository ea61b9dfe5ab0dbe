"""Choosing pass-KV or pass-Q (Meta, "Context Parallelism for Scalable
Million-Token Inference", arXiv 2411.01783, section 3).

With T new tokens, P cached, NKV / NH key-value / query heads, N ranks,
per-rank compute C (FLOP/s), ring bandwidth BW (bytes/s), e bytes/element:

    pass-KV  if  T / (T + P) >= 2 * NKV / NH                (KV is smaller than Q)
         or  if  T >= N * C * NKV * e / (2 * NH * BW)       (KV transfer hides behind compute)
    pass-Q   otherwise.

Decode (one new token with a cache) is always pass-Q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Algorithm = Literal["pass_kv", "pass_q"]


@dataclass(frozen=True)
class Choice:
    algorithm: Algorithm
    miss_rate: float
    miss_rate_threshold: float
    token_threshold: float
    reason: str


def explain_algorithm(
    new_tokens: int,
    cached_tokens: int,
    num_kv_heads: int,
    num_q_heads: int,
    num_ranks: int,
    flops_per_s: float,
    bandwidth_bytes_per_s: float,
    bytes_per_element: int = 2,
) -> Choice:
    """The heuristic's decision together with the numbers behind it."""
    if new_tokens < 1 or cached_tokens < 0:
        raise ValueError(f"need new_tokens >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if flops_per_s <= 0 or bandwidth_bytes_per_s <= 0 or bytes_per_element <= 0:
        raise ValueError("flops_per_s, bandwidth_bytes_per_s and bytes_per_element must be positive")

    miss_rate = new_tokens / (new_tokens + cached_tokens)
    miss_threshold = 2 * num_kv_heads / num_q_heads
    token_threshold = (
        num_ranks * flops_per_s * num_kv_heads * bytes_per_element / (2 * num_q_heads * bandwidth_bytes_per_s)
    )
    if new_tokens == 1 and cached_tokens > 0:
        return Choice("pass_q", miss_rate, miss_threshold, token_threshold, "decode")
    if miss_rate >= miss_threshold:
        reason = f"miss rate {miss_rate:.3f} >= {miss_threshold:.3f}"
        return Choice("pass_kv", miss_rate, miss_threshold, token_threshold, reason)
    if new_tokens >= token_threshold:
        reason = f"T={new_tokens} >= {token_threshold:.0f} (transfer hides behind compute)"
        return Choice("pass_kv", miss_rate, miss_threshold, token_threshold, reason)
    reason = f"miss rate {miss_rate:.3f} < {miss_threshold:.3f} and T={new_tokens} < {token_threshold:.0f}"
    return Choice("pass_q", miss_rate, miss_threshold, token_threshold, reason)


def select_algorithm(
    new_tokens: int,
    cached_tokens: int,
    num_kv_heads: int,
    num_q_heads: int,
    num_ranks: int,
    flops_per_s: float,
    bandwidth_bytes_per_s: float,
    bytes_per_element: int = 2,
) -> Algorithm:
    return explain_algorithm(
        new_tokens,
        cached_tokens,
        num_kv_heads,
        num_q_heads,
        num_ranks,
        flops_per_s,
        bandwidth_bytes_per_s,
        bytes_per_element,
    ).algorithm
