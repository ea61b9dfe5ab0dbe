"""One generation as the ranks run it: the request the client sends and the events rank 0 streams
back, as plain dataclasses. Only `cluster.py` turns them into gRPC messages and back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationRequest:
    tokens: list[int]  # new tokens to prefill, after the first keep_tokens the ranks hold
    keep_tokens: int = 0  # cached tokens to keep; later ones are dropped first
    max_tokens: int = 0
    algorithm: str = "pass_kv"  # the prefill's, a name in cpchat.core.algorithms
    decode: str = "exchange"  # how decode steps share partial outputs
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: list[int] = field(default_factory=list)  # generation ends after one of these
    request_id: str = ""  # empty: the cluster names it
    save_prefix: bool = False  # the ranks save what they hold after the answer (the prefix cache)
    keep_state_at: int = 0  # linear layers also keep their state after this many of `tokens` (0: no)
    shares: tuple[int, ...] = ()  # each rank's share of `tokens` (cpchat.core.sharding); empty: equal
    top_logprobs: int = 0  # each token also names this many most likely tokens, with theirs
    # "lookup" or "draft": each decode step also checks proposed tokens (the same answer)
    speculation: str = "off"
    draft_tokens: int = 0  # tokens proposed a step; 0: adaptive (lookup) or 3 (a draft model)
    draft_model: str = ""  # "draft": the model that proposes, as the ranks resolve a model
    sequence: str = ""  # the conversation the ranks continue (each held by name)


@dataclass(frozen=True)
class StepRow:
    """One answer's row in a batched decode step: its conversation reads `token` and samples token `index`
    of the answer, as its GenerationRequest samples."""

    sequence: str
    token: int
    index: int
    request: GenerationRequest


@dataclass(frozen=True)
class LayerDone:
    """The prefill passed one more layer."""

    layer: int
    num_layers: int


@dataclass(frozen=True)
class PrefillDone:
    ms: float  # the slowest rank's prefill
    linear_layers: str  # how linear-attention layers crossed the ring; "" for a model without them
    state_combine_ms: float  # of ms, the linear layers' halo exchange and state combine
    stage_wait_ms: tuple[float, ...] = ()  # per rank: its wait for the previous pipeline stage


@dataclass(frozen=True)
class TokenOut:
    id: int
    logprob: float  # under the full, untempered distribution
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this step, if asked, best first


@dataclass(frozen=True)
class RankDone:
    """One rank at the end of a request: what it holds, and what the ring may keep next time."""

    kv_tokens: int
    kv_bytes: int
    rss_bytes: int
    cached_tokens: int  # tokens the whole ring holds in its KV
    cancelled: bool
    keep_floor: int  # a later request keeps at least this many tokens, or none
    state_bytes: int
    state_positions: tuple[int, ...]  # where linear layers' states can roll back to; empty: anywhere
    proposed: int = 0  # speculative decoding: tokens proposed and accepted, and the decode steps
    accepted: int = 0
    decode_steps: int = 0


@dataclass(frozen=True)
class GenerationDone:
    done: RankDone  # rank 0's


GenerationEvent = LayerDone | PrefillDone | TokenOut | GenerationDone
