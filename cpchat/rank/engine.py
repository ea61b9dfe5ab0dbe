"""The rank's engine: an mlx-lm model with context-parallel attention, this
rank's KV shard, and the generation loop every rank runs in lockstep.

Prefill lays this rank's head-tail chunks out as two rows of a batch; decode
runs the single new token on every rank (so all hidden states agree) and
stores its K/V on one rank, chosen round-robin by position.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cpchat.core.sharding import head_tail_layout, owner_of
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank import context_parallel
from cpchat.rank.context_parallel import RingPass, ShardCache, StepTiming
from cpchat.rank.kvstore import KVShard
from cpchat.rank.ring import Aborted, Ring
from cpchat.rank.wire import BlockKey

# mlx-lm model modules whose attention fits the hook (verified by the test suite).
SUPPORTED_MODULES = ("llama", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    pass


class BadRequest(ValueError):
    pass


@dataclass
class ModelInfo:
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_element: int
    max_context: int


def load_model(path: str):
    """Load with mlx-lm and install ring attention; refuse architectures that do not fit."""
    from mlx_lm import load

    model, _tokenizer, config = load(path, return_config=True)
    module_name = type(model).__module__.rsplit(".", 1)[-1]
    if module_name not in SUPPORTED_MODULES:
        raise UnsupportedModel(
            f"model type {config.get('model_type', module_name)!r} is not supported for context parallelism "
            f"(supported: {', '.join(SUPPORTED_MODULES)}, mistral)"
        )
    if any(getattr(layer, "use_sliding", False) for layer in model.layers):
        raise UnsupportedModel("sliding-window attention is not supported for context parallelism")
    context_parallel.install(importlib.import_module(type(model).__module__))
    attn = model.layers[0].self_attn
    weight = model.layers[0].self_attn.q_proj.weight
    info = ModelInfo(
        model_type=config.get("model_type", module_name),
        num_layers=len(model.layers),
        num_q_heads=attn.n_heads,
        num_kv_heads=attn.n_kv_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // attn.n_heads,
        vocab_size=config["vocab_size"],
        bytes_per_element=weight.dtype.size if weight.dtype != mx.uint32 else 2,
        max_context=int(config.get("max_position_embeddings") or 0),
    )
    return model, info


def _logits(model, hidden: mx.array) -> mx.array:
    if hasattr(model, "lm_head"):
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def sample(logits: mx.array, sampling: pb.Sampling, index: int) -> tuple[int, float]:
    """The next token and its log-probability under the untempered distribution."""
    from mlx_lm.sample_utils import make_sampler

    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if sampling.temperature > 0:
        mx.random.seed((sampling.seed * 1_000_003 + index) % (1 << 32))
    top_p = sampling.top_p if 0 < sampling.top_p < 1 else 0.0
    token = make_sampler(sampling.temperature, top_p)(logprobs[None])
    token = int(token.item())
    return token, float(logprobs[token].item())


class Engine:
    """A loaded model plus this rank's KV shard; runs one request at a time."""

    def __init__(self) -> None:
        self.model = None
        self.info: ModelInfo | None = None
        self.kv: KVShard | None = None
        self.total_tokens = 0  # tokens the whole ring holds
        self.last_timings: list[StepTiming] = []
        self.last_algorithm = ""

    def load(self, path: str) -> ModelInfo:
        self.model, self.info = load_model(path)
        self.kv = KVShard(self.info.num_layers)
        self.total_tokens = 0
        return self.info

    def reset(self, keep_tokens: int = 0) -> None:
        if keep_tokens > self.total_tokens:
            raise BadRequest(f"cannot keep {keep_tokens} tokens: the ring holds {self.total_tokens}")
        self.kv.truncate(keep_tokens)
        self.total_tokens = keep_tokens

    # ---- one forward pass

    def _forward(self, ring_pass: RingPass, ids: mx.array) -> mx.array:
        caches = [ShardCache(ring_pass, i) for i in range(self.info.num_layers)]
        hidden = self.model.model(ids, cache=caches)
        mx.eval(hidden)
        if ring_pass.store:
            self.kv.commit()
        return hidden

    def _prefill(
        self, req: pb.GenerateRequest, ring: Ring, abort: threading.Event, on_layer
    ) -> mx.array | None:
        tokens, n, start = list(req.tokens), ring.size, self.total_tokens
        layout = head_tail_layout(len(tokens), n, ring.rank)
        local = layout.positions()
        real = np.array(layout.real_mask())
        ids = mx.array([tokens[p] if p < len(tokens) else 0 for p in local]).reshape(2, layout.chunk)
        positions = start + np.array(local, dtype=np.int64)
        self.kv.begin_append(positions[real])
        mode = "pass_q" if req.algorithm == pb.PASS_Q else "pass_kv"
        ring_pass = RingPass(
            request_id=req.request_id,
            mode=mode,
            ring=ring,
            kv=self.kv,
            row_offsets=mx.array([start + s for s in layout.starts]),
            q_positions=positions,
            real=real,
            store=True,
            abort=abort,
            on_layer=on_layer,
        )
        hidden = self._forward(ring_pass, ids)
        self._record(ring_pass)
        self.total_tokens = start + len(tokens)
        if owner_of(len(tokens) - 1, len(tokens), n) != ring.rank:
            return None
        last = local.index(len(tokens) - 1)
        return _logits(self.model, hidden.reshape(-1, hidden.shape[-1])[last])

    def _decode(
        self, req: pb.GenerateRequest, ring: Ring, abort: threading.Event, token: int
    ) -> mx.array | None:
        position = self.total_tokens
        store = position % ring.size == ring.rank
        if store:
            self.kv.begin_append(np.array([position]))
        ring_pass = RingPass(
            request_id=req.request_id,
            mode="decode",
            ring=ring,
            kv=self.kv,
            row_offsets=position,
            q_positions=np.array([position]),
            real=np.array([True]),
            store=store,
            abort=abort,
        )
        hidden = self._forward(ring_pass, mx.array([[token]]))
        self._record(ring_pass)
        self.total_tokens = position + 1
        return _logits(self.model, hidden[0, -1]) if ring.rank == 0 else None

    def _record(self, ring_pass: RingPass) -> None:
        self.last_timings = ring_pass.timings
        self.last_algorithm = ring_pass.mode

    # ---- the generation loop

    def validate(self, req: pb.GenerateRequest) -> None:
        if self.model is None:
            raise BadRequest("no model is loaded")
        if not req.tokens:
            raise BadRequest("the request has no tokens")
        bad = [t for t in req.tokens if t >= self.info.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")
        if req.keep_tokens > self.total_tokens:
            raise BadRequest(f"cannot keep {req.keep_tokens} tokens: the ring holds {self.total_tokens}")

    def generate(
        self,
        req: pb.GenerateRequest,
        ring: Ring,
        abort: threading.Event,
        emit: Callable[[pb.GenerateEvent], None],
    ) -> None:
        """Prefill req.tokens after keep_tokens, then decode; every rank runs this
        together. On abort or failure the shard rolls back to keep_tokens."""
        self.validate(req)
        self.reset(req.keep_tokens)
        mx.reset_peak_memory()
        start = self.total_tokens
        stop = set(req.stop_tokens)

        def on_layer(layer: int) -> None:
            emit(
                pb.GenerateEvent(progress=pb.LayerProgress(layer=layer + 1, num_layers=self.info.num_layers))
            )

        try:
            t0 = time.perf_counter()
            logits = self._prefill(req, ring, abort, on_layer)
            source = owner_of(len(req.tokens) - 1, len(req.tokens), ring.size)
            token, logprob = self._agree(req, ring, abort, source, 0, logits)
            emit(pb.GenerateEvent(prefill=pb.PrefillDone(ms=1000 * (time.perf_counter() - t0))))
            for index in range(req.max_tokens):
                if token in stop:
                    break
                emit(pb.GenerateEvent(token=pb.TokenEvent(id=token, logprob=logprob)))
                if index + 1 >= req.max_tokens:
                    break
                if abort.is_set():
                    raise Aborted(req.request_id)
                logits = self._decode(req, ring, abort, token)
                token, logprob = self._agree(req, ring, abort, 0, index + 1, logits)
        except BaseException:
            self.reset(start)
            raise
        finally:
            ring.mailbox.forget(req.request_id)

    def _agree(self, req, ring: Ring, abort, source: int, index: int, logits) -> tuple[int, float]:
        """The source rank samples; the token travels the ring so every rank has it."""
        key = BlockKey(req.request_id, 0, index, pb.TOKEN)
        if ring.rank == source:
            token, logprob = sample(logits, req.sampling, index)
            if ring.size > 1:
                ring.send(key, [mx.array([token], mx.int32), mx.array([logprob], mx.float32)])
            return token, logprob
        (token_a, logprob_a), _ = ring.take(key, abort)
        if ring.next_rank != source:
            ring.send(key, [token_a, logprob_a])
        return int(token_a.item()), float(logprob_a.item())
