"""The rank's engine: an mlx-lm model with context-parallel attention, this rank's KV shard, and the
generation every rank runs in lockstep: a prefill of its head-tail chunks, laid out as two rows of a
batch, then the decode (cpchat.rank.decode_loop)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from cpchat.core.algorithms import BY_NAME
from cpchat.core.estimate import PrefillCost
from cpchat.core.memory import ForwardMemory
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat, quantized_from
from cpchat.core.sharding import Shares, head_tail_layout, owner_of, owners, rank_tokens
from cpchat.core.stages import pipeline_cuts
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank import gathered, linear_layers
from cpchat.rank.algorithms import ATTEND, DECODE, PREFILL
from cpchat.rank.calibration import measure_prefill
from cpchat.rank.context_parallel import LayerCall, RingPass, StepMeans, StepTiming
from cpchat.rank.cpu_products import COPY_SHARE, keep_float32_weights
from cpchat.rank.decode_loop import RANK_0_ALONE, DecodeLoop
from cpchat.rank.draft import DraftModel, DraftModelError
from cpchat.rank.forward import run_model
from cpchat.rank.kvstore import KVShard
from cpchat.rank.measures import MeasureStore
from cpchat.rank.memory import free_bytes, return_freed_blocks
from cpchat.rank.model_load import ModelShape, load_model
from cpchat.rank.prefix_cache import CacheMiss, Found
from cpchat.rank.prefix_keeper import PrefixKeeper
from cpchat.rank.prefix_shard import restore
from cpchat.rank.sequences import Parked, why_not_keep
from cpchat.rank.speculation import Speculation
from cpchat.rank.stages import Handoff, StagePlace, context_ring
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Ring


class BadRequest(ValueError):
    pass


def check_shares(shares: Sequence[int], ranks: int) -> None:
    """Refuse shares (a request's, or a batched step's row's) that a ring of `ranks` cannot take."""
    if shares and (len(shares) != ranks or min(shares) < 1):
        raise BadRequest(f"{ranks} ranks need {ranks} positive shares, got {list(shares)}")


def _shares(req: pb.GenerateRequest) -> Shares | None:
    """The request's shares of the new tokens (None: equal)."""
    return tuple(req.shares) or None


class Engine:
    """A loaded model plus this rank's KV shard of the conversation it runs (others parked); runs one
    request at a time."""

    def __init__(self, measures: MeasureStore | None = None, memory_limit: int | None = None) -> None:
        self.model = None
        self.info: ModelShape | None = None
        self.kv: KVShard | None = None
        self.states = StateStore()
        self.total_tokens = 0  # tokens the whole ring holds
        self.last_timings: list[StepTiming] = []
        self.last_algorithm = ""
        self._answer_steps = ("", StepMeans())  # the request whose decode steps last_timings averages
        self.layer_calls: dict[int, LayerCall] = {}
        self.prefill_cost = PrefillCost(0, 0, 0)  # of the loaded model, measured once when it loads
        self.forward_memory = ForwardMemory(0, 0)  # likewise
        self.measures = measures or MeasureStore(None)  # where loads find their model's measured cost
        self.weight_bytes = 0
        self.keep_floor = 0
        self.model_name = ""
        self.prefix = PrefixKeeper()
        self.parked = Parked()  # the conversations held besides the one running
        # The last token sampled and not yet read (the ring's next position): mlx-lm reads it alone.
        self.unread: tuple[int, int] | None = None
        self.stage_waits: list[float] = []  # seconds this request's prefill waited for the stage before
        self.speculated = (0, 0, 0)  # the last answer's proposed and accepted tokens, and its decode steps
        self.draft: DraftModel | None = None  # --speculate draft:MODEL, on the rank that samples
        self.memory_limit = memory_limit  # bytes this process may hold in all (--memory-limit)
        self.copy_budget = 0

    def load(self, path: str, kv_format: KVFormat = FULL_PRECISION,
             place: Callable[[int], StagePlace] | None = None) -> ModelShape:
        """Load a model (the layers `place` gives this rank) if its weights fit what the rank may hold;
        on the CPU, with float32 copies of its low-precision weights where they take at most
        1/COPY_SHARE of that (cpchat.rank.cpu_products)."""
        free = free_bytes(self.memory_limit)
        self.model, self.info = load_model(path, kv_format, place, free)
        self.model_name = path
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        budget = free // COPY_SHARE if mx.default_device() == mx.cpu else 0
        copies = keep_float32_weights(self.model, budget)
        self.weight_bytes += copies
        self.copy_budget = budget - copies  # left for a draft model's copies
        stage = self.info.place
        key = self.measures.key(self.info.structure, stage.first, stage.end, self.weight_bytes)
        self.prefill_cost, self.forward_memory = self.measures.measured(
            key, lambda: measure_prefill(self.model, self.info))
        self.kv = self.new_kv()
        self.states = StateStore()
        self.total_tokens = 0
        self.prefix.forget(0)
        self.parked.clear()
        self.prefix.run_layers(self.info.place.first, self.info.place.end, self.info.place.stages > 1)
        return self.info

    def new_kv(self) -> KVShard:
        """An empty K/V shard for this model (a conversation's)."""
        return KVShard(self.info.num_layers, self.info.linear, self.info.kv_format, self.info.elsewhere)

    def use(self, sequence: str) -> None:
        """Run conversation `sequence`, parking the one running; one this rank does not hold starts empty."""
        self.parked.switch(self, sequence, self.new_kv)

    def release(self, sequence: str) -> None:
        """Let conversation `sequence` go (the running one: to no tokens), its memory to the system."""
        if not self.parked.release(sequence) and sequence == self.parked.running:
            self.reset(0)
        return_freed_blocks()

    def forget_all(self) -> None:
        """Let every conversation go (a new front end, or a ring whose shards were of another)."""
        self.parked.clear()
        self.reset(0)
        return_freed_blocks()

    def reset(self, keep_tokens: int = 0) -> None:
        self._check_keep(keep_tokens)
        self.kv.truncate(keep_tokens)
        if self.info.linear and keep_tokens != self.total_tokens:  # _check_keep: a snapshot holds it
            self.states.restore(keep_tokens)
        self.total_tokens = keep_tokens
        self.prefix.forget(keep_tokens)
        if self.unread is not None and self.unread[0] != keep_tokens:
            self.unread = None
        if keep_tokens == 0:
            self.keep_floor = 0

    def _check_keep(self, keep_tokens: int, sequence: str | None = None) -> None:
        """Refuse to keep what conversation `sequence` (None: the one running) cannot keep."""
        held = self.parked.find(self, self.parked.running if sequence is None else sequence)
        if reason := why_not_keep(held, keep_tokens, bool(self.info.linear)):
            raise BadRequest(f"cannot keep {keep_tokens} tokens: {reason}")

    def _forget_outside_windows(self, prompt_end: int, rollback_to: int) -> None:
        """Sliding-window layers drop the keys no query from `prompt_end` on can see (q - k >= window),
        except the last `window` before `rollback_to`, which queries after a roll back to it would see."""
        for i, layer in enumerate(self.info.layers):
            if layer.window:
                p = self.kv.layer_positions(i)
                needed = (p > rollback_to - layer.window) & (p < rollback_to)
                self.kv.forget(i, (p <= prompt_end - layer.window) & ~needed)

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

    # ---- one forward pass

    def ring_pass(self, request_id: str, algorithm: str, ring: Ring, abort: threading.Event,
                  positions: np.ndarray, real: np.ndarray, row_offsets: mx.array | int, start: int,
                  seq_len: int, **extra) -> RingPass:
        """A forward of this model over `positions` (this rank's, flattened; `real` the ones not padding)
        of `seq_len` new tokens from global position `start`; `extra` as RingPass takes them."""
        return RingPass(request_id=request_id, algorithm=algorithm, ring=ring, abort=abort,
                        **{"kv": self.kv, "store": True, **extra}, row_offsets=row_offsets,
                        q_positions=positions, real=real, windows=self.windows, linear=self.info.linear,
                        states=self.states, start=start, seq_len=seq_len, crossing=ATTEND[algorithm])

    def handoff(self, world: Ring, request_id: str, step: int, abort: threading.Event,
                context_rank: int) -> Handoff | None:
        """How a forward of a pipeline stage takes and hands on hidden states (None: one stage)."""
        place = self.info.place
        if place.stages == 1:
            return None
        return Handoff(world, place, request_id, step, abort, context_rank, self.stage_waits)

    def _prefill(self, req: pb.GenerateRequest, tokens: list[int], world: Ring, ring: Ring,
                 abort: threading.Event, on_layer: Callable[[int], None] | None,
                 request_id: str) -> mx.array | None:
        n, start, shares = ring.size, self.total_tokens, _shares(req)
        layout = head_tail_layout(len(tokens), n, ring.rank, shares)
        local = layout.positions()
        real = np.array(layout.real_mask())
        ids = mx.array([tokens[p] if p < len(tokens) else 0 for p in local]).reshape(2, layout.chunk)
        positions = start + np.array(local, dtype=np.int64)
        self.kv.begin_append(positions[real])
        ring_pass = self.ring_pass(request_id, PREFILL[req.algorithm].name, ring, abort, positions, real,
                                   mx.array([start + s for s in layout.starts]), start, len(tokens),
                                   on_layer=on_layer, shares=shares)
        mine = owner_of(len(tokens) - 1, len(tokens), n, shares) == ring.rank and self.info.place.last_stage
        logits = run_model(self.model, ring_pass, ids, row=local.index(len(tokens) - 1) if mine else 0,
                           handoff=self.handoff(world, request_id, start, abort, ring.rank))
        self.record(ring_pass)
        self.total_tokens = start + len(tokens)
        self.prefix.read_prefill(start, tokens, shares)
        return logits if mine else None

    def record(self, ring_pass: RingPass) -> None:
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

    def record_no_pass(self, algorithm: str) -> None:
        """A decode step this rank takes no part in (a gather step on a rank but 0): no ring steps."""
        self.last_timings, self.last_algorithm = [], f"decode_{algorithm}"

    # ---- the generation

    def validate(self, req: pb.GenerateRequest, ranks: int) -> None:
        """Refuse a request this rank cannot run in a ring of `ranks` ranks (all stages')."""
        if self.model is None:
            raise BadRequest("no model is loaded")
        place = self.info.place
        if place.stages > 1:
            if place.stages * place.ring_size != ranks:
                raise BadRequest(f"the model was loaded as {place.stages} stages of {place.ring_size} ranks, "
                                 f"but the ring has {ranks}: load it again")
            ranks = place.ring_size
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
        check_shares(req.shares, ranks)
        bad = [t for t in req.tokens if t >= self.info.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")
        self._check_keep(req.keep_tokens, req.sequence)
        limit = self.info.exact_tokens
        if limit and req.keep_tokens + len(req.tokens) + req.max_tokens > limit:
            raise BadRequest(f"{self.info.model_type}'s RoPE changes with the sequence length past {limit} "
                             "tokens (dynamic scaling), where mlx-lm's own answer depends on how it cuts the "
                             f"prompt: cpchat serves it up to {limit} tokens, prompt and answer together")

    def generate(
        self,
        req: pb.GenerateRequest,
        world: Ring,
        abort: threading.Event,
        emit: Callable[[pb.GenerateEvent], None],
    ) -> None:
        """Prefill req.tokens after keep_tokens, then decode; every rank runs this
        together. On abort or failure the shard rolls back to keep_tokens. Sliding-window
        layers keep only the keys that queries from the end of the prompt on can see. `world` is the
        whole ring; a pipeline stage's context ranks are a part of it (cpchat.rank.stages)."""
        if self.model is not None:
            self.use(req.sequence)
        self.validate(req, world.size)
        ring = context_ring(world, self.info.place)
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
        # Every stage cuts where the states are kept, linear layers or not: their passes must meet.
        state_at = start + int(req.keep_state_at) if req.keep_state_at else None
        # Passes: the prompt is cut where the K/V turn quantized, where a state is kept, and (pipeline
        # stages) into chunks that follow one another through the stages.
        chunks = pipeline_cuts(start, end, self.info.place.stages)
        inside = {c for c in (quantize_at, state_at, *chunks) if c is not None and start < c < end}
        cuts = [start, *sorted(inside), end]
        passes = list(zip(cuts, cuts[1:]))
        longest = max(passes, key=lambda p: p[1] - p[0])
        self.stage_waits = []
        self.unread = None

        def quantize_by(position: int) -> None:
            """mlx-lm's check before a call that reads from `position`."""
            if quantize_at is not None and position >= quantize_at and not self.kv.quantized:
                self.kv.quantize()

        answer = DecodeLoop(self, req, world, ring, abort)
        draft = self._draft(req, ring) if req.speculation == pb.SPECULATION_DRAFT and \
            world.rank == answer.sampler else None
        saving = req.save_prefix and self.prefix.cache is not None
        try:
            t0 = time.perf_counter()
            self.states.snapshot(start, keep=kept)
            for i, (a, b) in enumerate(passes):
                quantize_by(a)
                last = i == len(passes) - 1
                logits = self._prefill(req, tokens[a - start:b - start], world, ring, abort,
                                       on_layer if (a, b) == longest and not chunks else None,
                                       req.request_id if last else f"{req.request_id}#{i}")
                if chunks:  # stages: progress by passes, each through this rank's layers
                    emit(pb.GenerateEvent(progress=pb.LayerProgress(layer=i + 1, num_layers=len(passes))))
                if b == state_at:
                    kept.add(b)
                    self.states.snapshot(b, keep=kept)
            tokens = tokens[passes[-1][0] - start:]
            prompt_end = self.total_tokens
            self.states.snapshot(prompt_end, keep=kept)
            before_forgetting = {i: self.kv.layer(i) for i, w in enumerate(self.windows)
                                 if w and saving}
            if self.slides:
                self.keep_floor = start  # a roll back still needs the window before `start`
                self._forget_outside_windows(prompt_end, rollback_to=start)
            if answer.step_kind == "gather" and ring.rank and req.max_tokens > 1:
                gathered.send_shard(self.kv, ring, req.request_id)  # while the first token is sampled
            source = owner_of(len(tokens) - 1, len(tokens), ring.size, _shares(req))
            first = answer.sample_and_share(self.info.place.world_rank(self.info.place.stages - 1, source), 0,
                                            logits)
            combine_ms = sum(t.wait_ms + t.compute_ms for t in self.last_timings  # what the ring added
                             if t.layer in self.info.linear and t.step != linear_layers.RUN_STEP)
            emit(pb.GenerateEvent(prefill=pb.PrefillDone(ms=1000 * (time.perf_counter() - t0),
                                                         linear_layers=self.linear_summary(ring.size),
                                                         state_combine_ms=combine_ms,
                                                         stage_wait_ms=1000 * sum(self.stage_waits))))
            speculation = (Speculation(answer, quantize_at, draft, self.prefill_cost.query_s(len(self.kv)))
                           if req.speculation else None)
            try:
                with answer.threads():
                    token = (speculation or answer).run(emit, first, stop, quantize_by)
            finally:
                self.speculated = speculation.counts if speculation else (0, 0, 0)
            if self.slides:
                self._forget_outside_windows(prompt_end, rollback_to=prompt_end)
                self.keep_floor = prompt_end
            if req.max_tokens:
                self.unread = (self.total_tokens, token)
            if saving:
                self.prefix.save(self.kv, self.states, self.windows, before_forgetting, prompt_end,
                                 self.info.identity, self.model_name, ring)
                if draft is not None:
                    draft.save(self.prefix)
        except BaseException:
            self.reset(start)
            raise
        finally:
            for request_id in [req.request_id, *(f"{req.request_id}#{i}" for i in range(len(passes) - 1))]:
                world.mailbox.forget(request_id)

    def load_draft(self, name: str, free: int | None = None) -> DraftModel:
        """The draft model `name`, loaded at its first use and kept (this rank samples): refused by name
        where its weights take more than `free` bytes (this rank's free memory if None)."""
        if self.model is None:
            raise BadRequest("no model is loaded")
        try:
            if self.draft is None or self.draft.name != name:
                self.draft = None
                free = free_bytes(self.memory_limit) if free is None else free
                self.draft = DraftModel(name, self.copy_budget, free)
        except DraftModelError as e:
            raise BadRequest(str(e)) from None
        return self.draft

    def _draft(self, req: pb.GenerateRequest, ring: Ring) -> DraftModel:
        """The request's draft model, if it and its K/V of the whole conversation fit beside this
        request's own (refused by name otherwise), holding what it can of the conversation."""
        tokens = req.keep_tokens + len(req.tokens) + req.max_tokens
        mine = rank_tokens(len(req.tokens), ring.size, _shares(req))[ring.rank] + req.max_tokens // ring.size
        free = free_bytes(self.memory_limit) - mine * self.info.kv_bytes_per_token
        draft = self.load_draft(req.draft_model, free)
        try:
            draft.check_room(tokens, free)
        except DraftModelError as e:
            raise BadRequest(str(e)) from None
        draft.resume(self.prefix, np.append(self.prefix.tokens, np.array(req.tokens, np.uint32)))
        return draft

    # ---- the prefix cache

    def find_prefixes(self, tokens: list[int]) -> list[Found]:
        """The saved prefixes that begin like `tokens`, saves under way included."""
        return self.prefix.find(self.info.identity, tokens) if self.model is not None else []

    def load_prefix(self, prefix: str, num_ranks: int, tokens: int, ring: Ring, sequence: str = "") -> None:
        """Hold a saved prefix cut to `tokens` as conversation `sequence`: this rank's own shard of it, or
        (saved by a ring of another size, on this disk) from every shard the positions a prefill would
        give this rank."""
        if self.model is None:
            raise BadRequest("no model is loaded")
        self.use(sequence)
        ring = context_ring(ring, self.info.place)
        cache = self.prefix.cache
        if cache is None:
            raise CacheMiss("this rank keeps no prefix cache (--no-cache)")
        same = num_ranks == ring.size
        wanted = [ring.rank] if same else range(num_ranks)
        shards = [part for s in wanted for part in self.prefix.load(prefix, s, num_ranks, self.info.identity)]
        for header, _ in shards:
            if not header["floor"] <= tokens <= header["tokens"] or (
                    header["state_positions"] and tokens not in header["state_positions"]):
                raise CacheMiss(f"prefix {prefix} cannot be cut at {tokens} tokens")

        def mine(p: np.ndarray) -> np.ndarray:
            if same:
                return np.ones(len(p), bool)
            return (p < tokens) & (owners(np.minimum(p, tokens - 1), tokens, ring.size) == ring.rank)

        try:
            self.kv, self.states = restore(shards, tokens, self.info.num_layers, self.info.linear, mine,
                                           self.info.kv_format, self.info.elsewhere)
        except (KeyError, ValueError, IndexError, StopIteration) as e:  # whole files that do not fit
            for s in wanted:
                for part in cache.parts(prefix, s, num_ranks):
                    cache.discard(cache.path(prefix, s, num_ranks, part))
            raise CacheMiss(f"removed prefix {prefix}: its arrays do not fit this model ({e})") from None
        self.total_tokens = tokens
        self.unread = None
        self.keep_floor = max(h["floor"] for h, _ in shards)
        self.prefix.loaded(prefix, shards, tokens, ring)
