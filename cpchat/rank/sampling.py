"""Choosing the next token from a rank's logits, as mlx-lm's samplers do, and the event that carries it."""

from __future__ import annotations

import mlx.core as mx

from cpchat.protocol import cpchat_pb2 as pb

MAX_TOP_LOGPROBS = 20


def sample(logits: mx.array, sampling: pb.Sampling, index: int) -> list[mx.array]:
    """The next token and its log-probability under the untempered distribution, as arrays of one
    element (a graph, until evaluated); then, if asked, the most likely tokens and theirs."""
    from mlx_lm.sample_utils import make_sampler

    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if sampling.temperature > 0:
        mx.random.seed((sampling.seed * 1_000_003 + index) % (1 << 32))
    top_p = sampling.top_p if 0 < sampling.top_p < 1 else 0.0
    token = make_sampler(sampling.temperature, top_p)(logprobs[None])
    k = min(sampling.top_logprobs, MAX_TOP_LOGPROBS, logprobs.size)
    if not k:
        return [token, logprobs[token]]
    top = mx.argpartition(-logprobs, k - 1)[:k]
    top = top[mx.argsort(-logprobs[top])]
    return [token, logprobs[token], top.astype(mx.uint32), logprobs[top]]


def token_event(sampled: list[mx.array]) -> pb.TokenEvent:
    """`sample`'s arrays (evaluated here) as the event a rank emits."""
    token, logprob, *top = sampled
    event = pb.TokenEvent(id=int(token.item()), logprob=float(logprob.item()))
    if top:
        event.top_ids.extend(top[0].tolist())
        event.top_logprobs.extend(top[1].tolist())
    return event
