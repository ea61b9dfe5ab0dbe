"""The ranks' protobuf messages as the front end's own dataclasses, and back."""

from __future__ import annotations

import uuid

from cpchat.client.events import RankStats, RingStep
from cpchat.client.generation import (
    GenerationEvent,
    GenerationRequest,
    LayerDone,
    PrefillDone,
    RankDone,
    StepRow,
    TokenOut,
)
from cpchat.client.ranks import RankHandle
from cpchat.core.algorithms import BY_NAME
from cpchat.protocol import cpchat_pb2 as pb


def _sampling(g: GenerationRequest) -> pb.Sampling:
    return pb.Sampling(temperature=g.temperature, top_p=g.top_p, seed=g.seed, top_logprobs=g.top_logprobs)


def generate_request(g: GenerationRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=g.request_id or uuid.uuid4().hex, keep_tokens=g.keep_tokens, tokens=g.tokens,
        algorithm=pb.Algorithm.Value(BY_NAME[g.algorithm].wire), max_tokens=g.max_tokens,
        sampling=_sampling(g),
        stop_tokens=g.stop_tokens, decode=pb.Decode.Value(BY_NAME[g.decode].wire), save_prefix=g.save_prefix,
        keep_state_at=g.keep_state_at, shares=g.shares,
        speculation=pb.Speculation.Value(f"SPECULATION_{g.speculation.upper()}"), draft_tokens=g.draft_tokens,
        draft_model=g.draft_model, sequence=g.sequence,
    )


def step_request(rows: list[StepRow]) -> pb.StepRequest:
    return pb.StepRequest(step_id=uuid.uuid4().hex, rows=[
        pb.StepRow(sequence=r.sequence, token=r.token, index=r.index, sampling=_sampling(r.request),
                   shares=r.request.shares) for r in rows])


def token_out(t: pb.TokenEvent) -> TokenOut:
    return TokenOut(t.id, t.logprob, tuple(zip(t.top_ids, t.top_logprobs, strict=True)))


def generation_event(e: pb.GenerateEvent) -> GenerationEvent:
    which = e.WhichOneof("event")
    if which == "progress":
        return LayerDone(e.progress.layer, e.progress.num_layers)
    if which == "prefill":
        return PrefillDone(e.prefill.ms, e.prefill.linear_layers, e.prefill.state_combine_ms)
    return token_out(e.token)


def rank_done(d: pb.GenerateDone) -> RankDone:
    return RankDone(d.kv_tokens, d.kv_bytes, d.rss_bytes, d.cached_tokens, d.cancelled, d.keep_floor,
                    d.state_bytes, tuple(d.state_positions), d.proposed, d.accepted, d.decode_steps)


def rank_stats(r: RankHandle, s: pb.RankStats) -> RankStats:
    return RankStats(
        rank=r.rank, address=r.address, state=s.state, kv_tokens=s.kv_tokens, kv_bytes=s.kv_bytes,
        rss_bytes=s.rss_bytes, mlx_active_bytes=s.mlx_active_bytes, mlx_peak_bytes=s.mlx_peak_bytes,
        peak_rss_bytes=s.peak_rss_bytes, data_plane_bytes_sent=s.data_plane_bytes_sent,
        state_bytes=s.state_bytes, sequences=s.sequences, algorithm=s.algorithm, blas=r.blas_label,
        slow_blas=r.slow_blas, threads=r.blas.threads,
        ring_steps=[RingStep(t.layer, t.step, t.compute_ms, t.wait_ms, t.bytes_sent) for t in s.ring_steps],
    )
