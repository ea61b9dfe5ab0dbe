"""The rank's engine: an mlx-lm model with context-parallel attention, this
rank's KV shard, and the generation loop every rank runs in lockstep.

Prefill lays this rank's head-tail chunks out as two rows of a batch; decode
runs the single new token on every rank (so all hidden states agree) and
stores its K/V on one rank, chosen round-robin by position.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from cpchat import blas
from cpchat.checkpoints.resolve import is_checkpoint, model_dir
from cpchat.core.algorithms import BY_NAME
from cpchat.core.attention import partial_attention
from cpchat.core.estimate import PrefillCost, line_through, rank_pairs
from cpchat.core.memory import ForwardMemory
from cpchat.core.quantized_kv import BITS, FULL_PRECISION, GROUP_SIZES, KVFormat, quantized_from
from cpchat.core.sharding import Shares, decode_owner, head_tail_layout, owner_of, owners
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank import context_parallel, fit, gathered, latent_attention, linear_layers
from cpchat.rank.algorithms import DECODE, PREFILL, decode
from cpchat.rank.context_parallel import LayerCall, RingPass, ShardCache, StepMeans, StepTiming
from cpchat.rank.cpu_products import COPY_SHARE, MIN_ROWS, keep_float32_weights, use_float32_products
from cpchat.rank.fit import LayerAttention, LayerRecurrence, UnsupportedModel
from cpchat.rank.kvstore import KVShard
from cpchat.rank.linear_layers import StateCache
from cpchat.rank.prefix_cache import CacheMiss, Entry, Found, Layout, PrefixStore, model_identity, prefix_id
from cpchat.rank.prefix_shard import capture, restore
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Aborted, Mailbox, Ring
from cpchat.rank.transport.wire import BlockKey

# Decode steps that rank 0 runs alone (cpchat.rank.algorithms.decode): the others cannot advance a
# recurrent state with it, and rank 0 takes every core for its products.
RANK_0_ALONE = frozenset({"lead", "gather"})


class BadRequest(ValueError):
    pass


class KVFormatRefused(ValueError):
    """The model cannot keep its K/V in the format asked for; the message says why, by name."""


@dataclass
class ModelShape:
    """What this rank found in the model it loaded: head counts and sizes, and each layer's needs."""

    model_type: str
    num_layers: int  # layers with a cache: attention layers (KV) and linear layers (a recurrent state)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_element: int  # of the K/V the ranks hold and send
    max_context: int
    layers: list[LayerAttention | LayerRecurrence]
    exact_tokens: int | None  # past this, mlx-lm's own RoPE depends on how it cuts the prompt
    latent: bool = False  # MLA layers: keys and values are a compressed latent
    kv_format: KVFormat = FULL_PRECISION
    identity: str = ""  # the model's files and the settings its K/V depend on (prefix_cache.model_identity)

    @property
    def linear(self) -> frozenset[int]:
        """The layers that keep a recurrent state."""
        return frozenset(i for i, layer in enumerate(self.layers) if isinstance(layer, LayerRecurrence))

    @property
    def first_attention(self) -> LayerAttention:
        return next(layer for layer in self.layers if isinstance(layer, LayerAttention))


def load_model(name: str, kv_format: KVFormat = FULL_PRECISION):
    """Load with mlx-lm (a directory, a hub id `ORG/NAME[@revision]` or a checkpoint to convert, each
    resolved on this machine), install ring attention, and find out what each layer's attention needs."""
    from mlx_lm import load
    from mlx_lm.utils import _download

    if is_checkpoint(name):  # a GGUF file, an Ollama model or a named one: converted on this machine
        name = str(model_dir(name))
    path, revision = (name, None) if Path(name).exists() else _split_revision(name)
    try:
        model, _tokenizer, config = load(path, return_config=True, revision=revision)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModel(str(e)) from None
        raise
    context_parallel.install()
    linear_layers.install()
    latent = latent_attention.adapt(model) > 0
    linear_layers.adapt(model)
    max_positions = int(config.get("max_position_embeddings") or 0)
    exact_tokens = fit.fit_rotary(model, max_positions)
    usable = fit.usable_context(config)
    if mx.default_device() == mx.cpu:
        use_float32_products(model)
    local = Path(path) if Path(path).exists() else Path(_download(path, revision=revision))
    vocab_size = _vocab_size(model, config)
    layers = fit.describe_layers(model, _probe_forward(model, vocab_size))
    first = next(layer for layer in layers if isinstance(layer, LayerAttention))  # cache_slots saw one
    info = ModelShape(
        model_type=config.get("model_type", fit.model_name(model)),
        num_layers=len(layers),
        num_q_heads=first.query_heads,
        num_kv_heads=first.key_heads,
        head_dim=first.key_dim,
        vocab_size=vocab_size,
        bytes_per_element=first.dtype_bytes,
        max_context=min(filter(None, (usable, exact_tokens)), default=0),  # 0: the config does not say
        layers=layers,
        exact_tokens=exact_tokens,
        latent=latent,
        kv_format=kv_format,
    )
    check_kv_format(info)
    settings = {"device": str(mx.default_device()), "kv_bytes": first.dtype_bytes,
                "kv_format": [kv_format.bits, kv_format.group_size, kv_format.start]}
    info.identity = model_identity(local, settings)
    return model, info


def check_kv_format(info: ModelShape) -> None:
    """Refuse, by name, what mlx-lm itself cannot quantize (or MLX cannot group)."""
    fmt = info.kv_format
    if not fmt.quantized:
        return
    if fmt.bits not in BITS or fmt.group_size not in GROUP_SIZES:
        raise KVFormatRefused(f"--kv-bits {fmt.bits} --kv-group-size {fmt.group_size}: cpchat quantizes K/V "
                              f"to {' or '.join(map(str, BITS))} bits in groups of "
                              f"{', '.join(map(str, GROUP_SIZES))}")
    attention = [layer for layer in info.layers if isinstance(layer, LayerAttention)]
    name = info.model_type
    if any(layer.window for layer in attention):
        raise KVFormatRefused(f"--kv-bits: {name}'s sliding-window layers keep a rotating cache, which "
                              "mlx-lm cannot quantize (RotatingKVCache has no quantized form)")
    if any(layer.sinks for layer in attention):
        raise KVFormatRefused(f"--kv-bits: {name}'s attention sinks are not supported by mlx-lm's quantized "
                              "attention")
    if info.latent:
        raise KVFormatRefused(f"--kv-bits: {name}'s multi-head latent attention caches a compressed latent, "
                              "which mlx-lm does not quantize")
    dims = sorted({d for layer in attention for d in (layer.key_dim, layer.value_dim)})
    if any(d % fmt.group_size for d in dims):
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        hint = f": try --kv-group-size {fits[-1]}" if fits else ""
        raise KVFormatRefused(f"--kv-group-size {fmt.group_size} does not divide {name}'s head size "
                              f"{'/'.join(map(str, dims))} (K/V are quantized in groups along it){hint}")


def _split_revision(name: str) -> tuple[str, str | None]:
    repo, _, revision = name.partition("@")
    return repo, revision or None


def _vocab_size(model, config: dict) -> int:
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(vocab or model.model.embed_tokens.weight.shape[0])


def _probe_forward(model, vocab_size: int, chunk: int = 3) -> fit.ProbeResult:
    """One forward through a ring of one rank, laid out as a prefill is (two rows of `chunk`
    tokens at different positions), recording what every layer's attention was given. The token
    ids stay inside the vocabulary: MLX's gather does not check, and read past the embedding."""
    slots = fit.cache_slots(model)
    linear = frozenset(i for i, s in enumerate(slots) if s.state)
    kv = KVShard(len(slots), linear)
    ring = Ring(0, 1, {}, Mailbox(lambda frame, size: None))
    positions = np.arange(2 * chunk)
    ring_pass = RingPass(
        request_id="probe", algorithm="pass_kv", ring=ring, kv=kv, row_offsets=mx.array([0, chunk]),
        q_positions=positions, real=np.ones(2 * chunk, bool), store=True,
        abort=threading.Event(), windows=[s.window for s in slots], linear=linear, states=StateStore(),
        seq_len=2 * chunk,
    )
    kv.begin_append(positions)
    try:
        ids = mx.arange(2 * chunk) % vocab_size
        _run_model(model, ring_pass, ids.reshape(2, chunk), row=2 * chunk - 1)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{fit.model_name(model)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any failure means the hook does not fit this model
        raise UnsupportedModel(
            f"{fit.model_name(model)}: the model does not run with cpchat's context-parallel "
            f"layout (rows of tokens at different positions, attention through the ring): "
            f"{type(e).__name__}: {e}") from None
    return fit.ProbeResult(slots, ring_pass.calls, kv, ring_pass.recurrences, ring_pass.states)


def measure_prefill(model, info: ModelShape) -> tuple[PrefillCost, ForwardMemory]:
    """Time this model here: attention of 1024 queries over 2048 keys for each query-key pair's cost,
    in tiles with every pair visible and in tiles with a causal mask (a prefill's tiles are that
    large, cpchat.core.estimate); then a forward of a few tokens and one long enough to take about
    0.6 s more (up to 1024 tokens), less their own attention at those costs, for the weights' work.
    Each is the median of a few runs, not the fastest: a prefill sums many such calls, the odd slow
    one included. The short forward has MIN_ROWS tokens a row, so both run the products a prefill
    runs (below that, a low-precision model's run MLX's native kernels, many times slower a token).
    The same two forwards' peak memory, less the K/V they stored, gives what a forward of T tokens
    allocates for its activations; a forward of one token a row, a decode step's cost."""
    layer, queries, keys = info.first_attention, 1024, 2048
    q = mx.random.normal((1, layer.query_heads, queries, layer.key_dim))
    k = mx.random.normal((1, layer.key_heads, keys, layer.key_dim))
    v = mx.random.normal((1, layer.key_heads, keys, layer.value_dim))
    mx.eval(q, k, v)
    layers = info.num_layers - len(info.linear)

    def per_pair_s(first_query: int, key_count: int, warm_up: int = 0) -> float:
        """Seconds a pair, the queries from `first_query` on over the first `key_count` keys (after
        `warm_up` runs untimed)."""
        q_pos, k_pos = np.arange(first_query, first_query + queries), np.arange(key_count)

        def once() -> float:
            start = time.perf_counter()
            mx.eval(*partial_attention(q, k[:, :, :key_count], v[:, :, :key_count], q_pos, k_pos, scale=1.0))
            return time.perf_counter() - start

        runs = [once() for _ in range(warm_up + 5)][warm_up:]
        return statistics.median(runs) / (queries * key_count) * layers

    # A freshly loaded rank's first few tiles ran up to twice as slowly as the rest (measured).
    visible = per_pair_s(keys, keys, warm_up=4)  # every pair visible
    masked = max(per_pair_s(0, queries), visible)  # one tile on the diagonal: a causal mask
    attention = PrefillCost(0, 0, visible, 0, masked)
    groups = max(layer.query_heads // layer.key_heads, 1)
    peaks: dict[int, int] = {}

    def forward_s(tokens: int) -> float:
        """A prefill forward of `tokens` on one rank."""
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        kv = _probe_forward(model, info.vocab_size, tokens // 2).kv
        seconds = time.perf_counter() - start
        peaks[tokens] = mx.get_peak_memory() - held - kv.nbytes  # the activations: K/V are counted apart
        return seconds

    def typical_s(tokens: int) -> float:
        return statistics.median(forward_s(tokens) for _ in range(3))

    def own_attention_s(tokens: int) -> float:
        return attention.rank_seconds(0, rank_pairs(tokens, 0, 1, groups)[0])

    few = 2 * MIN_ROWS
    short = typical_s(few)
    tokens = int(min(max(few * 0.6 / max(short, 1e-6), 4 * few), 1024)) // 2 * 2
    long = typical_s(tokens)
    fixed, per_token = line_through(few, short - own_attention_s(few), tokens, long - own_attention_s(tokens))
    if per_token == 0:  # a tiny model's products, lost in its attention's noise: count them with it
        fixed, per_token = line_through(few, short, tokens, long)
    memory = ForwardMemory(*line_through(few, peaks[few], tokens, peaks[tokens]))
    step = typical_s(2)  # rows of one token: a decode step's kernels
    return PrefillCost(fixed, per_token, visible, step, masked), memory


def _run_model(model, ring_pass: RingPass, ids: mx.array, row: int, evaluate: bool = True) -> mx.array:
    """The model's own __call__ (so its output path — softcapping, logit scaling — runs as in
    mlx-lm) over this rank's rows, with the head applied to one flattened row only; evaluated, or
    left a graph for the caller to evaluate."""
    caches = [StateCache(ring_pass, i) if i in ring_pass.linear else ShardCache(ring_pass, i)
              for i in range(ring_pass.kv.num_layers)]
    with fit.head_on_row(model, row):
        logits = model(ids, cache=caches)
    if evaluate:
        mx.eval(logits)
    if ring_pass.store:
        ring_pass.kv.commit(evaluate)
    return logits[0, 0]


def _shares(req: pb.GenerateRequest) -> Shares | None:
    """The request's shares of the new tokens (None: equal)."""
    return tuple(req.shares) or None


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


def _covers(new: dict, old: dict) -> bool:
    """Whether a new save serves every cut the old one served (so the old file can go)."""
    return new["floor"] <= old["floor"] and set(old["state_positions"]) <= set(new["state_positions"])


class Engine:
    """A loaded model plus this rank's KV shard; runs one request at a time."""

    def __init__(self) -> None:
        self.model = None
        self.info: ModelShape | None = None
        self.kv: KVShard | None = None
        self.states = StateStore()
        self.total_tokens = 0  # tokens the whole ring holds
        self.last_timings: list[StepTiming] = []
        self.last_algorithm = ""
        self._answer_steps = ("", StepMeans())  # the request whose decode steps last_timings averages
        self.layer_calls: dict[int, LayerCall] = {}
        self.gathered: gathered.Gathered | None = None  # rank 0's view of every rank's K/V in a gather decode
        self.handing: deque[tuple[int, int, gathered.NewKV]] = deque()  # its steps' new K/V, to hand on
        self._streams = threading.local()
        self.prefill_cost = PrefillCost(0, 0, 0)  # of the loaded model, measured once when it loads
        self.forward_memory = ForwardMemory(0, 0)  # likewise
        self.weight_bytes = 0
        self.keep_floor = 0
        # The prefix cache (None: --no-cache): what the ring holds is described by its token ids and
        # layout; `origin` is the saved prefix it continues, superseded by the next save.
        self.cache: PrefixStore | None = None
        self.model_name = ""
        self.tokens = np.zeros(0, np.uint32)
        self.segments: list[tuple[int, ...]] = []  # (start, length[, shares...]) of each prefill
        self.origin: Entry | None = None
        # The last token sampled and not yet read (the ring's next position): mlx-lm reads it alone.
        self.unread: tuple[int, int] | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-writer")
        self._saves: list[Future] = []

    def load(self, path: str, kv_format: KVFormat = FULL_PRECISION, free_bytes: int = 0) -> ModelShape:
        """Load a model; on the CPU, with float32 copies of its low-precision weights where they take
        at most 1/COPY_SHARE of the `free_bytes` the rank may use (cpchat.rank.cpu_products)."""
        self.model, self.info = load_model(path, kv_format)
        self.model_name = path
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        if mx.default_device() == mx.cpu:
            self.weight_bytes += keep_float32_weights(self.model, free_bytes // COPY_SHARE)
        self.prefill_cost, self.forward_memory = measure_prefill(self.model, self.info)
        self.kv = KVShard(self.info.num_layers, self.info.linear, kv_format)
        self.states = StateStore()
        self.total_tokens = 0
        self._forget_history(0)
        return self.info

    def reset(self, keep_tokens: int = 0) -> None:
        self._check_keep(keep_tokens)
        self.kv.truncate(keep_tokens)
        if self.info.linear and keep_tokens != self.total_tokens:  # _check_keep: a snapshot holds it
            self.states.restore(keep_tokens)
        self.total_tokens = keep_tokens
        self._forget_history(keep_tokens)
        if self.unread is not None and self.unread[0] != keep_tokens:
            self.unread = None
        if keep_tokens == 0:
            self.keep_floor = 0

    def _forget_history(self, keep_tokens: int) -> None:
        self.tokens = self.tokens[:keep_tokens]
        self.segments = [s for s in self.segments if s[0] < keep_tokens]
        if self.origin is not None and self.origin.header["tokens"] > keep_tokens:
            self.origin = None

    def _check_keep(self, keep_tokens: int) -> None:
        if keep_tokens > self.total_tokens:
            raise BadRequest(f"cannot keep {keep_tokens} tokens: the ring holds {self.total_tokens}")
        if 0 < keep_tokens < self.keep_floor:
            raise BadRequest(f"cannot keep {keep_tokens} tokens: sliding-window layers hold keys for "
                             f"{self.keep_floor} tokens on; keep those or none")
        if self.info.linear and keep_tokens not in (self.total_tokens, *self.states.snapshots):
            held = ", ".join(map(str, sorted({self.total_tokens, *self.states.snapshots})))
            raise BadRequest(f"cannot keep {keep_tokens} tokens: linear-attention layers hold their state "
                             f"after {held} tokens only")

    def _forget_outside_windows(self, prompt_end: int, rollback_to: int) -> None:
        """Sliding-window layers drop the keys no query from `prompt_end` on can see (q - k >= window),
        except the last `window` before `rollback_to`, which queries after a roll back to it would see."""
        for i, layer in enumerate(self.info.layers):
            if layer.window:
                p = self.kv.layer_positions(i)
                needed = (p > rollback_to - layer.window) & (p < rollback_to)
                self.kv.forget(i, (p <= prompt_end - layer.window) & ~needed)

    # ---- one forward pass

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.info.layers]

    @property
    def slides(self) -> bool:
        return any(self.windows)

    @property
    def state_positions(self) -> list[int]:
        """Token counts the linear layers' states can roll back to, besides all and none."""
        return sorted(p for p in self.states.snapshots if p) if self.info.linear else []

    def linear_summary(self, ranks: int) -> str:
        """How the linear layers ran in a prefill, for the prefill event and the Ring panel."""
        linear = [self.info.layers[i] for i in sorted(self.info.linear)]
        if not linear:
            return ""
        kinds = ", ".join(sorted({layer.recurrence for layer in linear}))
        return (f"{len(linear)} of {self.info.num_layers} layers linear ({kinds}): {2 * ranks} chunks "
                f"on {ranks} rank{'s' * (ranks > 1)}, each run once from a stacked zero-and-identity state, "
                "their transforms all-gathered and folded in order; convolution halos exchanged")

    def _prefill(
        self, req: pb.GenerateRequest, tokens: list[int], ring: Ring, abort: threading.Event, on_layer,
        request_id: str = "",
    ) -> mx.array | None:
        n, start, shares = ring.size, self.total_tokens, _shares(req)
        layout = head_tail_layout(len(tokens), n, ring.rank, shares)
        local = layout.positions()
        real = np.array(layout.real_mask())
        ids = mx.array([tokens[p] if p < len(tokens) else 0 for p in local]).reshape(2, layout.chunk)
        positions = start + np.array(local, dtype=np.int64)
        self.kv.begin_append(positions[real])
        ring_pass = RingPass(
            request_id=request_id or req.request_id,
            algorithm=PREFILL[req.algorithm].name,
            ring=ring,
            kv=self.kv,
            row_offsets=mx.array([start + s for s in layout.starts]),
            q_positions=positions,
            real=real,
            store=True,
            abort=abort,
            windows=self.windows,
            on_layer=on_layer,
            linear=self.info.linear,
            states=self.states,
            start=start,
            seq_len=len(tokens),
            shares=shares,
        )
        mine = owner_of(len(tokens) - 1, len(tokens), n, shares) == ring.rank
        logits = _run_model(self.model, ring_pass, ids, row=local.index(len(tokens) - 1) if mine else 0)
        self._record(ring_pass)
        self.total_tokens = start + len(tokens)
        self.tokens = np.concatenate([self.tokens, np.array(tokens, np.uint32)])
        self.segments.append((start, len(tokens), *(shares or ())))  # unequal shares hold other positions
        return logits if mine else None

    def _decode(
        self, req: pb.GenerateRequest, ring: Ring, abort: threading.Event, token: int | mx.array,
        evaluate: bool = True,
    ) -> mx.array | None:
        """One token's step; `token` may be a graph still being evaluated (a pipelined step, which
        is left a graph too)."""
        position = self.total_tokens
        keeper = decode_owner(position, ring.size, _shares(req))
        if DECODE[req.decode].name == "gather" and ring.size > 1:
            logits = self._gather_step(req, ring, abort, token, position, keeper, evaluate)
            self.total_tokens = position + 1
            return logits
        store = keeper == ring.rank
        if store:
            self.kv.begin_append(np.array([position]))
        ring_pass = RingPass(
            request_id=req.request_id,
            algorithm=DECODE[req.decode].name,
            ring=ring,
            kv=self.kv,
            row_offsets=position,
            q_positions=np.array([position]),
            real=np.array([True]),
            store=store,
            abort=abort,
            windows=self.windows,
            linear=self.info.linear,
            states=self.states,
            start=position,
            seq_len=1,
            keeper=keeper,
        )
        if ring_pass.algorithm == "lead" and ring.rank != 0:
            decode.follow(ring_pass, [self.layer_calls[i] for i in sorted(self.layer_calls)])
            if store:
                self.kv.commit()
            logits = None
        else:
            ids = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[token]])
            logits = _run_model(self.model, ring_pass, ids, row=0, evaluate=evaluate)
        self._record(ring_pass)
        self.total_tokens = position + 1
        return logits if ring.rank == 0 else None

    def _gather_step(self, req: pb.GenerateRequest, ring: Ring, abort: threading.Event, token: int | mx.array,
                     position: int, keeper: int, evaluate: bool) -> mx.array | None:
        """A gather decode step (cpchat.rank.gathered): rank 0 runs it alone over every rank's K/V, as a
        rank alone does, and `_hand_on` gives the new token's K/V to the rank that keeps them once
        evaluated; the others only keep theirs."""
        self.last_timings, self.last_algorithm = [], "decode_gather"
        if ring.rank != 0:
            if keeper == ring.rank:
                arrays, _ = ring.take(gathered.new_kv_key(req.request_id, position), abort, 0)
                self._keep_new(position, gathered.unpack_new(arrays))
            return None
        if self.gathered is None:
            self.gathered = gathered.gather_shards(self.kv, ring, abort, req.request_id)
        if self.kv.quantized and not self.gathered.quantized:
            self.gathered.quantize()
        self.gathered.new.begin_append(np.array([position]))
        ring_pass = RingPass(
            request_id=req.request_id, algorithm="gather", ring=Ring(0, 1, {}, ring.mailbox),
            kv=self.gathered.new, row_offsets=position, q_positions=np.array([position]),
            real=np.array([True]), store=True, abort=abort, windows=self.windows, start=position, seq_len=1,
            keeper=keeper, hand_on=True, held=self.gathered.blocks(self.kv),
        )
        ids = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[token]])
        logits = _run_model(self.model, ring_pass, ids, row=0, evaluate=evaluate)
        self._record(ring_pass)
        self.handing.append((position, keeper, ring_pass.unkept))
        return logits

    def _hand_on(self, req: pb.GenerateRequest, ring: Ring, index: int, sampled: list[mx.array]) -> None:
        """After a gather step is evaluated: its new K/V to the rank that keeps them, its token to
        every other rank. On an MLX stream of their own: the default one is evaluating the next step,
        and anything queued behind it would wait for it."""
        position, keeper, new = self.handing.popleft()
        if not hasattr(self._streams, "side"):  # MLX streams belong to the thread that made them
            self._streams.side = mx.new_stream(mx.cpu)
        with mx.stream(self._streams.side):
            if keeper:  # rank 0's own are in self.gathered.new until the answer ends
                ring.send(gathered.new_kv_key(req.request_id, position), gathered.pack_new(new), to=keeper)
            self._send_token(req, ring, index, sampled)

    def _keep_new(self, position: int, new: gathered.NewKV) -> None:
        self.kv.begin_append(np.array([position]))
        for layer, (k, v) in sorted(new.items()):
            self.kv.append(layer, k, v)
        self.kv.commit()

    def _answer(self, req: pb.GenerateRequest, ring: Ring, abort: threading.Event, emit,
                first: pb.TokenEvent, stop: set[int], quantize_by: Callable[[int], None]) -> int:
        """Emit the first token and decode the rest; the last token (emitted, or the stop token).
        A rank alone runs as mlx-lm's generate_step does: the step after next is built from the next
        token before that token is known, so building one step overlaps evaluating the other, and a
        step built from what turns out to be a stop token is forgotten; so does rank 0 in gather steps,
        handing each step on once evaluated. Other ranks of a ring take each token from the
        sampling rank before they step (linear layers' states keep that order too)."""
        alone = ring.size == 1 or (ring.rank == 0 and DECODE[req.decode].name == "gather")
        pipelined = alone and not self.info.linear

        def step(previous: int | mx.array, index: int) -> list[mx.array]:
            quantize_by(self.total_tokens)
            pending = sample(self._decode(req, ring, abort, previous, evaluate=False), req.sampling, index)
            mx.async_eval(*pending)
            return pending

        event, ahead = first, None  # ahead: the step that gives token index + 1, under way
        for index in range(req.max_tokens):
            token = event.id
            if token in stop:
                break
            emit(pb.GenerateEvent(token=event))
            if index + 1 >= req.max_tokens:
                break
            if abort.is_set():
                raise Aborted(req.request_id)
            if pipelined:
                ahead = step(token, index + 1) if ahead is None else ahead
                following = step(ahead[0], index + 2) if index + 2 < req.max_tokens else None
                self.tokens = np.append(self.tokens, np.uint32(token))
                event = token_event(ahead)
                if ring.size > 1:  # a gather step, handed on while the next one evaluates
                    self._hand_on(req, ring, index + 1, ahead)
                ahead = following
            else:
                quantize_by(self.total_tokens)
                logits = self._decode(req, ring, abort, token)
                self.tokens = np.append(self.tokens, np.uint32(token))
                event = self._agree(req, ring, abort, 0, index + 1, logits)
        if ahead is not None:  # built from a stop token: its K/V go
            self.total_tokens -= 1
            self.kv.truncate(self.total_tokens)
        if self.gathered is not None:
            shares = _shares(req)
            self.gathered.hand_back(self.kv, lambda p: decode_owner(p, ring.size, shares) == 0,
                                    below=self.total_tokens)
        return event.id

    @staticmethod
    def _decode_threads(req: pb.GenerateRequest, ring: Ring) -> contextlib.AbstractContextManager:
        """In a lead or gather decode step rank 0 runs the weight products alone, on every core of the
        machine."""
        if ring.rank == 0 and ring.size > 1 and DECODE[req.decode].name in RANK_0_ALONE:
            return blas.threads(blas.usable_cores())
        return contextlib.nullcontext()

    def _record(self, ring_pass: RingPass) -> None:
        """What Stats reports of the last ring pass: a prefill's steps, or a decode answer's means."""
        if ring_pass.decoding and ring_pass.timings:
            if self._answer_steps[0] != ring_pass.request_id:
                self._answer_steps = (ring_pass.request_id, StepMeans())
            self.last_timings = self._answer_steps[1].add(ring_pass.timings)
        else:
            self._answer_steps = ("", StepMeans())
            self.last_timings = ring_pass.timings
        if ring_pass.layer_calls:
            self.layer_calls = ring_pass.layer_calls  # how each attention layer attends, for a lead step
        algorithm = BY_NAME[ring_pass.algorithm]  # RankStats.algorithm names a decode pass "decode_NAME"
        self.last_algorithm = algorithm.name if algorithm.stage == "prefill" else f"decode_{algorithm.name}"

    # ---- the generation loop

    def validate(self, req: pb.GenerateRequest, ranks: int) -> None:
        if self.model is None:
            raise BadRequest("no model is loaded")
        if not req.tokens:
            raise BadRequest("the request has no tokens")
        if req.algorithm not in PREFILL:
            raise BadRequest(f"unknown algorithm {req.algorithm}")
        if req.decode not in DECODE:
            raise BadRequest(f"unknown decode exchange {req.decode}")
        step = DECODE[req.decode].name
        if step in RANK_0_ALONE and self.info.linear:
            raise BadRequest(f"{self.info.model_type}'s linear layers keep a state that every rank advances "
                             f"with every token: a {step} decode step, run by rank 0 alone, cannot serve it")
        if req.shares and (len(req.shares) != ranks or min(req.shares) < 1):
            raise BadRequest(f"{ranks} ranks need {ranks} positive shares, got {list(req.shares)}")
        bad = [t for t in req.tokens if t >= self.info.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")
        self._check_keep(req.keep_tokens)
        limit = self.info.exact_tokens
        if limit and req.keep_tokens + len(req.tokens) + req.max_tokens > limit:
            raise BadRequest(f"{self.info.model_type}'s RoPE changes with the sequence length past {limit} "
                             "tokens (dynamic scaling), where mlx-lm's own answer depends on how it cuts the "
                             f"prompt: cpchat serves it up to {limit} tokens, prompt and answer together")

    def generate(
        self,
        req: pb.GenerateRequest,
        ring: Ring,
        abort: threading.Event,
        emit: Callable[[pb.GenerateEvent], None],
    ) -> None:
        """Prefill req.tokens after keep_tokens, then decode; every rank runs this
        together. On abort or failure the shard rolls back to keep_tokens. Sliding-window
        layers keep only the keys that queries from the end of the prompt on can see."""
        self.validate(req, ring.size)
        self.reset(req.keep_tokens)
        mx.reset_peak_memory()
        start = self.total_tokens
        stop = set(req.stop_tokens)

        def on_layer(layer: int) -> None:
            emit(
                pb.GenerateEvent(progress=pb.LayerProgress(layer=layer + 1, num_layers=self.info.num_layers))
            )

        tokens, kept = list(req.tokens), {start}
        end = start + len(tokens)
        fmt, lone = self.info.kv_format, self.unread == (start, tokens[0])
        quantize_at = quantized_from(start, len(tokens), fmt.start, lone) \
            if fmt.quantized and not self.kv.quantized else None
        state_at = start + int(req.keep_state_at) if self.info.linear and req.keep_state_at else None
        # Passes: the prompt is cut where the K/V turn quantized and where a state is kept.
        inside = {c for c in (quantize_at, state_at) if c is not None and start < c < end}
        cuts = [start, *sorted(inside), end]
        passes = list(zip(cuts, cuts[1:]))
        longest = max(passes, key=lambda p: p[1] - p[0])
        self.unread = None

        def quantize_by(position: int) -> None:
            """mlx-lm's check before a call that reads from `position`."""
            if quantize_at is not None and position >= quantize_at and not self.kv.quantized:
                self.kv.quantize()

        try:
            t0 = time.perf_counter()
            self.states.snapshot(start, keep=kept)
            for i, (a, b) in enumerate(passes):
                quantize_by(a)
                last = i == len(passes) - 1
                logits = self._prefill(req, tokens[a - start:b - start], ring, abort,
                                       on_layer if (a, b) == longest else None,
                                       request_id=req.request_id if last else f"{req.request_id}#{i}")
                if b == state_at:
                    kept.add(b)
                    self.states.snapshot(b, keep=kept)
            tokens = tokens[passes[-1][0] - start:]
            prompt_end = self.total_tokens
            self.states.snapshot(prompt_end, keep=kept)
            before_forgetting = {i: self.kv.layer(i) for i, w in enumerate(self.windows)
                                 if w and req.save_prefix and self.cache is not None}
            if self.slides:
                self.keep_floor = start  # a roll back still needs the window before `start`
                self._forget_outside_windows(prompt_end, rollback_to=start)
            if DECODE[req.decode].name == "gather" and ring.rank and req.max_tokens > 1:
                gathered.send_shard(self.kv, ring, req.request_id)  # while the first token is sampled
            source = owner_of(len(tokens) - 1, len(tokens), ring.size, _shares(req))
            first = self._agree(req, ring, abort, source, 0, logits)
            combine_ms = sum(t.wait_ms + t.compute_ms for t in self.last_timings  # what the ring added
                             if t.layer in self.info.linear and t.step != linear_layers.RUN_STEP)
            emit(pb.GenerateEvent(prefill=pb.PrefillDone(ms=1000 * (time.perf_counter() - t0),
                                                         linear_layers=self.linear_summary(ring.size),
                                                         state_combine_ms=combine_ms)))
            with self._decode_threads(req, ring):
                token = self._answer(req, ring, abort, emit, first, stop, quantize_by)
            if self.slides:
                self._forget_outside_windows(prompt_end, rollback_to=prompt_end)
                self.keep_floor = prompt_end
            if req.max_tokens:
                self.unread = (self.total_tokens, token)
            if req.save_prefix and self.cache is not None:
                self._save(ring, before_forgetting, prompt_end)
        except BaseException:
            self.reset(start)
            raise
        finally:
            self.gathered = None
            self.handing.clear()
            for request_id in [req.request_id, *(f"{req.request_id}#{i}" for i in range(len(passes) - 1))]:
                ring.mailbox.forget(request_id)

    # ---- the prefix cache

    def _save(self, ring: Ring, before_forgetting: dict, prompt_end: int) -> None:
        """Capture this rank's shard here (the MLX thread) and write it on the writer thread."""
        layout = Layout(ring.size, tuple(self.segments))
        header, arrays = capture(self.kv, self.states, self.tokens, self.windows, before_forgetting,
                                 prompt_end)
        header |= {"prefix_id": prefix_id(self.info.identity, layout, self.tokens),
                   "model_key": self.info.identity, "model": self.model_name,
                   "num_ranks": ring.size, "shard": ring.rank,
                   "tokens": len(self.tokens), "segments": layout.segments, "saved": time.time()}
        origin = self.origin if self.origin is not None and _covers(header, self.origin.header) else None
        self.origin = Entry(self.cache.path(header["prefix_id"], ring.rank, ring.size), header)
        self._saves = [f for f in self._saves if not f.done()]
        self._saves.append(self._writer.submit(self._write, header, arrays, origin))

    def _write(self, header: dict, arrays: dict, replaces: Entry | None) -> None:
        try:
            self.cache.save(header, {name: np.asarray(a) for name, a in arrays.items()}, replaces)
        except OSError as e:  # a full or read-only disk costs the cache, never the answer
            print(f"cpchat rank: cannot save the prefix in {self.cache.root}: {e}", file=sys.stderr,
                  flush=True)

    def flush(self) -> None:
        """Wait for the prefix files being written."""
        for f in list(self._saves):
            f.result()

    def find_prefixes(self, tokens: list[int]) -> list[Found]:
        """The saved prefixes that begin like `tokens`, saves under way included."""
        if self.cache is None or self.model is None:
            return []
        self.flush()
        return self.cache.find(self.info.identity, np.array(tokens, np.uint32))

    def load_prefix(self, prefix: str, num_ranks: int, tokens: int, ring: Ring) -> None:
        """Hold a saved prefix cut to `tokens`: this rank's own shard of it, or (saved by a ring of
        another size, on this disk) from every shard the positions a prefill would give this rank."""
        if self.model is None:
            raise BadRequest("no model is loaded")
        if self.cache is None:
            raise CacheMiss("this rank keeps no prefix cache (--no-cache)")
        same = num_ranks == ring.size
        shards = [self.cache.load(prefix, s, num_ranks, self.info.identity)
                  for s in ([ring.rank] if same else range(num_ranks))]
        for header, _ in shards:
            if not header["floor"] <= tokens <= header["tokens"] or (
                    self.info.linear and tokens not in header["state_positions"]):
                raise CacheMiss(f"prefix {prefix} cannot be cut at {tokens} tokens")

        def mine(p: np.ndarray) -> np.ndarray:
            if same:
                return np.ones(len(p), bool)
            return (p < tokens) & (owners(np.minimum(p, tokens - 1), tokens, ring.size) == ring.rank)

        header = shards[0][0]
        try:
            self.kv, self.states = restore(shards, tokens, self.info.num_layers, self.info.linear, mine,
                                           self.info.kv_format)
        except (KeyError, ValueError, IndexError) as e:  # whole files (their digests hold) that do not fit
            for s in [ring.rank] if same else range(num_ranks):
                self.cache.discard(self.cache.path(prefix, s, num_ranks))
            raise CacheMiss(f"removed prefix {prefix}: its arrays do not fit this model ({e})") from None
        self.total_tokens = tokens
        self.unread = None
        self.tokens = shards[0][1]["tokens"][:tokens].copy()
        self.segments = [tuple(s) for s in header["segments"] if s[0] < tokens] if same else [(0, tokens)]
        self.keep_floor = max(h["floor"] for h, _ in shards)
        own = Entry(self.cache.path(prefix, ring.rank, num_ranks), header)
        self.origin = own if same and header["tokens"] == tokens else None

    def _agree(self, req, ring: Ring, abort, source: int, index: int, logits) -> pb.TokenEvent:
        """The source rank samples and sends the token to every other rank at once."""
        if ring.rank == source:
            sampled = sample(logits, req.sampling, index)
            mx.eval(sampled)
            self._send_token(req, ring, index, sampled)
            return token_event(sampled)
        arrays, _ = ring.take(BlockKey(req.request_id, 0, index, pb.TOKEN), abort, source)
        return token_event(arrays)

    @staticmethod
    def _send_token(req: pb.GenerateRequest, ring: Ring, index: int, sampled: list[mx.array]) -> None:
        if ring.size > 1:
            ring.send_all(BlockKey(req.request_id, 0, index, pb.TOKEN), [a.reshape(-1) for a in sampled],
                          ring.peers)
