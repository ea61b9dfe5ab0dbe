"""A ring of ranks as the front end sees it: launch or attach, configure,
load, generate, watch health, and tear down. Reaches ranks only over gRPC."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import fields
from pathlib import Path

import grpc

from cpchat.blas import BlasUnavailable
from cpchat.client.events import RankStats
from cpchat.client.generation import GenerationEvent, GenerationRequest, StepRow, TokenOut
from cpchat.client.launcher import LaunchError, LocalRank, launch_local_ranks, rank_devices, visible_gpus
from cpchat.client.messages import generate_request, rank_stats, step_request, token_out
from cpchat.client.prefixes import PrefixChoice, PrefixGone, PrefixLoaded, SavedPrefix
from cpchat.client.ranks import DraftHeld, RankHandle, ServedModel, describe_failure
from cpchat.client.streams import (
    HEALTH_DEADLINE_S,
    SILENCE_S,
    GenerationRun,
    RankResult,
    cancel_on,
    merged_stats,
    step_on,
    unanswering,
)
from cpchat.core.estimate import PrefillCost
from cpchat.core.memory import ForwardMemory
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.core.stages import ONE_STAGE, Stages, common_cuts
from cpchat.errors import BackendError, BadInput
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol import cpchat_pb2_grpc as pb_grpc
from cpchat.protocol.channel import open_channel, token_metadata

# How tensors travel between ranks: shared memory between ranks on one host and gRPC between hosts
# (auto); gRPC only; shared memory only (every rank on this host); or an mx.distributed group on the
# first backend every rank has, with shared memory or gRPC for the pairs it does not reach (mlx).
TRANSPORTS = ("auto", "grpc", "shm", "mlx")
DATA_PLANE_TIMEOUT_S = 60.0  # forming a group waits for every rank to connect
SHUTDOWN_S = 60.0  # a local rank finishes writing its prefix files before it answers
MESSAGE_SIZE = [("grpc.max_receive_message_length", 16 << 20)]


def parse_addresses(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadInput(f"bad rank address {a!r}: expected host:port")
    if not addresses:
        raise BadInput("no rank addresses given")
    return addresses


def read_hostfile(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise BadInput(f"cannot read hostfile {path}: {e.strerror}") from None
    entries = [ln.split("#", 1)[0].strip() for ln in lines]
    return parse_addresses(",".join(e for e in entries if e))


class Cluster:
    def __init__(
        self,
        addresses: list[str],
        token: str | None = None,
        tls_ca: bytes | None = None,
        local: list[LocalRank] | None = None,
        transport: str = "auto",
    ) -> None:
        if transport not in TRANSPORTS:
            raise BadInput(f"unknown transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        self.token, self.tls_ca, self.transport = token, tls_ca, transport
        self.metadata = token_metadata(token)
        self.ranks: list[RankHandle] = []
        for i, address in enumerate(addresses):
            channel = open_channel(address, tls_ca, MESSAGE_SIZE)
            handle = RankHandle(i, address, channel, pb_grpc.ControlStub(channel))
            handle.local = local[i] if local else None
            self.ranks.append(handle)
        self.model: ServedModel | None = None
        self.stages = 1  # pipeline stages, as the model was loaded
        self.flops_per_s = 0.0
        self.ring_bytes_per_s = 0.0
        self.link_latency_s: list[list[float]] = []  # [from rank][to rank], one way
        self.exchange_latency_s = 0.0
        self.prefill_cost: PrefillCost | None = None
        self.rank_costs: list[PrefillCost] = []  # each rank's, as it measured them
        self.forward_memory: list[ForwardMemory] = []  # per rank, with the loaded model
        self.ring_id = ""
        self.link_transports: list[list[str]] = []  # [from rank][to rank]: "shm" | "grpc" | "" (itself)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(addresses)))
        self._current_request = ""
        self._lock = threading.Lock()
        self.last_results: dict[int, RankResult] = {}
        self._closed = threading.Event()
        self._stats_threads: list[threading.Thread] = []

    # ---- life cycle

    @classmethod
    def launch(cls, num_ranks: int, blas_choice: str = "auto", pin_cpus: bool = False,
               transport: str = "auto", devices: str = "all", flags: Sequence[str] = (),
               threads: int | None = None) -> Cluster:
        """Local ranks, pinned one per visible GPU in turn unless devices is "none" (--devices), each
        running `threads` BLAS threads (default: the cores shared out)."""
        try:
            pinned = rank_devices(devices, visible_gpus())
        except ValueError as e:
            raise BadInput(str(e)) from None
        try:
            local = launch_local_ranks(num_ranks, blas_choice, pin_cpus, pinned, flags, threads)
        except LaunchError as e:
            raise BackendError(str(e)) from None
        except BlasUnavailable as e:
            raise BadInput(str(e)) from None
        return cls([r.address for r in local], local=local, transport=transport)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ring_size(self) -> int:
        """The context ranks of each pipeline stage: the ring a prefill's tokens are split over."""
        return self.size // self.stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of one pipeline stage (all of them for one stage), in ring order."""
        return list(range(stage * self.ring_size, (stage + 1) * self.ring_size))

    def context_costs(self) -> list[PrefillCost]:
        """Each context rank's prefill cost: its rows run through every stage, one after another."""
        return [PrefillCost(*(sum(getattr(self.rank_costs[s * self.ring_size + c], f.name)
                                  for s in range(self.stages)) for f in fields(PrefillCost)))
                for c in range(self.ring_size)]

    @property
    def is_local(self) -> bool:
        return all(r.local is not None for r in self.ranks)

    def _each(self, fn: Callable[[RankHandle], object], connecting: bool = False) -> list[object]:
        """Run fn on every rank at once; the first failure becomes a BackendError naming the rank.
        Returns or raises only once every rank has answered: a rank still loading when its neighbour
        refused the model would refuse the next load as busy."""
        futures = [self._pool.submit(fn, r) for r in self.ranks]
        wait(futures)
        results, errors = [], []
        for r, f in zip(self.ranks, futures, strict=True):
            try:
                results.append(f.result())
            except grpc.RpcError as e:
                r.state = "failed"
                errors.append(self._describe(r, e, connecting=connecting))
        if errors:
            raise BackendError(errors[0])
        return results

    def _describe(self, r: RankHandle, e: grpc.RpcError, phase: str = "", connecting: bool = False) -> str:
        return describe_failure(r, e, phase, connecting, tls=self.tls_ca is not None)

    def connect(self, timeout: float = 5.0) -> None:
        """Wait until every rank answers, then tell each its place in the ring."""

        def health(r: RankHandle) -> None:
            request = pb.HealthRequest()
            try:
                reply = r.control.Health(request, timeout=timeout, metadata=self.metadata,
                                         wait_for_ready=True)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                # Waiting hides why the connection failed; one plain call reports it.
                reply = r.control.Health(request, timeout=2.0, metadata=self.metadata)
            r.blas, r.cpu_cores, r.computes_on_cpu = reply.blas, reply.cpu_cores, reply.computes_on_cpu
            r.cpu_allowance = reply.cpu_allowance
            r.data_plane_backends, r.data_plane_port = tuple(reply.data_plane_backends), reply.data_plane_port
            return reply.shm_endpoint

        endpoints = self._each(health, connecting=True)
        self.ring_id = uuid.uuid4().hex
        addresses = [r.address for r in self.ranks]
        if self.transport == "grpc":
            endpoints = []
        backend = self.data_plane_backend()
        plane = [f"{r.host}:{r.data_plane_port}" for r in self.ranks] if backend else []

        def configure(r: RankHandle) -> list[str]:
            reply = r.control.Configure(
                pb.ConfigureRequest(rank=r.rank, addresses=addresses, ring_id=self.ring_id,
                                    shm_endpoints=endpoints, data_plane_backend=backend,
                                    data_plane_addresses=plane),
                timeout=DATA_PLANE_TIMEOUT_S if backend else timeout, metadata=self.metadata)
            r.state = "idle"
            return list(reply.transports) or ["" if i == r.rank else "grpc" for i in range(self.size)]

        self.link_transports = self._each(configure)
        remote = [(i, j) for i, row in enumerate(self.link_transports)
                  for j, t in enumerate(row) if t == "grpc"]
        if self.transport == "shm" and remote:
            i, j = remote[0]
            raise BadInput(f"--transport shm needs every rank on one host, but rank {i} reaches rank {j} "
                           f"only over the network")

    def data_plane_backend(self) -> str:
        """The mx.distributed backend the ranks' tensors take with --transport mlx: the first every
        rank offers ("" for none). `auto` takes none: the one backend with send and recv that MLX
        has here, its TCP ring, is slower than shared memory and no faster than gRPC
        (assets/bench/transport)."""
        if self.transport != "mlx" or self.size < 2:
            return ""
        shared = [b for b in self.ranks[0].data_plane_backends
                  if all(b in r.data_plane_backends for r in self.ranks)]
        if not shared:
            offered = "; ".join(f"{r.label}: {', '.join(r.data_plane_backends) or 'none'}"
                                for r in self.ranks)
            raise BadInput(f"--transport mlx needs an mx.distributed backend common to every rank "
                           f"({offered})")
        return shared[0]

    def _on_host_of(self, r: RankHandle) -> list[RankHandle]:
        """The ranks on r's host: those that share memory with r or its address."""
        links = self.link_transports
        return [s for s in self.ranks if s.host == r.host or (links and links[r.rank][s.rank] == "shm")]

    @property
    def one_machine(self) -> bool:
        """Whether every rank computes on the CPU cores of one machine."""
        on_cpu = all(r.computes_on_cpu for r in self.ranks)
        return on_cpu and len(self._on_host_of(self.ranks[0])) == self.size

    @property
    def spare_cores(self) -> bool:
        """Whether every host has a CPU core beyond those its ranks compute on, to move their tensors
        while they compute. Ranks share a host when they share memory or an address."""
        for r in self.ranks:
            if not r.computes_on_cpu:
                continue
            if len(self._on_host_of(r)) >= r.cpu_cores:
                return False
        return True

    @property
    def transport_label(self) -> str:
        """How the ranks' tensors travel: "mlx", "shm", "grpc", or a mix such as "shm+grpc"."""
        used = {t for row in self.link_transports for t in row if t}
        return "+".join(t for t in ("mlx", "shm", "grpc") if t in used) or "none"

    def slow_blas_warning(self) -> str | None:
        """One line for ranks whose CPU products run on the reference BLAS, with the fix."""
        slow = [r for r in self.ranks if r.slow_blas]
        if not slow:
            return None
        if len(slow) == self.size and self.is_local:
            who = "the ranks multiply"
        else:
            who = ", ".join(r.label for r in slow) + (" multiplies" if len(slow) == 1 else " multiply")
        return (f"{who} with the reference BLAS of the mlx[cpu] wheel, 20-30x slower than "
                f"OpenBLAS; install a fast one and restart: {slow[0].blas.fix}")

    def load(self, model: str, on_progress: Callable[[int, int], None] | None = None,
             kv_format: KVFormat = FULL_PRECISION, stages: Stages = ONE_STAGE) -> ServedModel:
        """Load the model on every rank (each from its own disk), its K/V kept in `kv_format`, the
        ranks forming `stages` pipeline stages (each rank reads only its stage's layers)."""
        if self.size % stages.count:
            raise BadInput(f"--stages {stages.count} does not divide {self.size} ranks into equal stages")
        request = pb.LoadModelRequest(model=model, kv_bits=kv_format.bits, kv_group_size=kv_format.group_size,
                                      quantized_kv_start=kv_format.start, stages=stages.count,
                                      stage_layers=stages.layers)
        done = [0]
        lock = threading.Lock()

        def load_one(r: RankHandle) -> pb.LoadProgress:
            r.state = "loading"
            last = None
            try:
                for progress in r.control.LoadModel(request, metadata=self.metadata):
                    last = progress
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                    raise
                r.state = "ready"  # the rank keeps the model it had
                # Attached ranks load from their own disks: say which one could not.
                raise BadInput(e.details() if self.is_local else f"{r.label}: {e.details()}") from None
            r.state = "ready"
            r.stage, r.layers = last.pipeline_stage, (last.first_layer, last.end_layer or last.num_layers)
            r.weight_bytes, r.state_layers = last.weight_bytes, last.state_layers
            r.products = {"packed": last.packed_layers, "float32": last.float32_layers}
            r.products_note = last.products_note
            with lock:
                done[0] += 1
                if on_progress:
                    on_progress(done[0], self.size)
            return last

        replies = self._each(load_one)
        self.stages = stages.count
        p = replies[0]
        heads = replies[::self.ring_size]  # a rank of each stage: their layers together are the model's
        self.model = ServedModel(model, p.model_type, p.num_layers, p.num_q_heads, p.num_kv_heads,
                                 p.vocab_size, p.bytes_per_element, p.max_context, p.head_dim, p.value_dim,
                                 sum(h.state_layers for h in heads),
                                 KVFormat(p.kv_bits, p.kv_group_size, kv_format.start),
                                 max(r.weight_bytes for r in replies), stages.count)
        self.calibrate()
        return self.model

    def calibrate(self) -> None:
        """Measure every rank's speed and every link (the ranks run it together); the slowest
        rank and link set the pace."""
        results = self._each(lambda r: r.control.Calibrate(pb.CalibrateRequest(), timeout=30,
                                                           metadata=self.metadata))
        self.flops_per_s = min(c.flops_per_s for c in results)
        self.ring_bytes_per_s = min(c.ring_bytes_per_s for c in results)
        self.link_latency_s = [list(c.link_latency_s) for c in results]
        self.exchange_latency_s = max(c.exchange_latency_s for c in results)
        self.rank_costs = [PrefillCost(c.prefill_fixed_s, c.prefill_per_token_s, c.prefill_per_pair_s,
                                       c.decode_step_s, c.prefill_per_masked_pair_s) for c in results]
        # Under equal shares the slowest rank sets the pace.
        self.prefill_cost = PrefillCost(max(c.prefill_fixed_s for c in results),
                                        max(c.prefill_per_token_s for c in results),
                                        max(c.prefill_per_pair_s for c in results),
                                        max(c.decode_step_s for c in results),
                                        max(c.prefill_per_masked_pair_s for c in results))
        self.forward_memory = [ForwardMemory(c.forward_fixed_bytes, c.forward_per_token_bytes)
                               for c in results]
        for r, reply in zip(self.ranks, self._health(), strict=True):
            r.cpu_allowance = reply.cpu_allowance

    def speeds(self) -> list[float]:
        """Tokens a second each rank's forward runs, as it measured (0 where it did not)."""
        if len(self.rank_costs) != self.size:
            return [0.0] * self.size
        return [1 / c.per_token_s if c.per_token_s else 0.0 for c in self.rank_costs]

    def free_memory(self) -> list[int]:
        """The bytes each rank may still allocate, as it reports them now."""
        return [reply.memory_free_bytes for reply in self._health()]

    def _health(self) -> list[pb.HealthReply]:
        """Every rank's Health, as a turn asks it (free memory, CPU allowance): a rank silent for
        SILENCE_S has stopped, by the rule its beats follow; one that pauses less is only slow."""
        return self._each(lambda r: r.control.Health(pb.HealthRequest(), timeout=SILENCE_S,
                                                     metadata=self.metadata))

    @property
    def equally_fast(self) -> bool:
        """Whether the ranks share one machine's CPU cores with the same allowance of them: then their
        speeds are the same, whatever calibrations made while they shared the cores say."""
        allowances = [r.cpu_allowance for r in self.ranks]
        return self.one_machine and max(allowances) <= 1.05 * min(allowances)

    @property
    def hop_latency_s(self) -> float:
        """The slowest ring link's latency (0 until measured)."""
        n, lat = self.size, self.link_latency_s
        return max((lat[r][(r + 1) % n] for r in range(n) if len(lat) == n and len(lat[r]) == n), default=0.0)

    def close(self) -> None:
        """Shut local ranks down (and wait for them); leave attached ranks running. A local rank that
        stopped answering is killed at once: a stopped process would answer Shutdown never."""
        self._closed.set()
        for r in self.ranks:
            if r.local is not None and r.state != "failed":
                with contextlib.suppress(grpc.RpcError):  # it answers once its prefix files are written
                    r.control.Shutdown(pb.ShutdownRequest(), timeout=SHUTDOWN_S, metadata=self.metadata)
        for r in self.ranks:
            if r.local is not None:
                r.local.stop(timeout=0 if r.state == "failed" else 3.0)
            r.channel.close()
        for t in self._stats_threads:
            t.join(timeout=2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests

    def reset(self, keep_tokens: int = 0, sequence: str | None = None) -> None:
        """Keep the first `keep_tokens` of a conversation the ranks hold (0: let it go; None: every one)."""
        request = pb.ResetRequest(keep_tokens=keep_tokens, sequence=sequence or "", every=sequence is None)
        self._each(lambda r: r.control.Reset(request, timeout=30, metadata=self.metadata))

    def find_prefixes(self, tokens: list[int]) -> list[list[SavedPrefix]]:
        """What each rank has saved on its disk that begins like `tokens`."""
        request = pb.FindPrefixesRequest(tokens=tokens)
        replies = self._each(lambda r: r.control.FindPrefixes(request, timeout=30, metadata=self.metadata))
        return [[SavedPrefix(p.prefix_id, p.num_ranks, p.shard, p.tokens, p.common, p.floor,
                             tuple(p.state_positions)) for p in reply.prefixes] for reply in replies]

    def load_draft(self, name: str) -> DraftHeld:
        """The rank that samples loads the draft model `name` (kept there); BadInput names a draft it cannot
        load or hold."""
        r = self.ranks[self.stage_ranks(self.stages - 1)[0]]
        try:
            reply = r.control.LoadDraft(pb.LoadDraftRequest(model=name), timeout=600, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadInput(e.details()) from None
            raise BackendError(self._describe(r, e, "a draft model's load")) from None
        return DraftHeld(reply.weight_bytes, reply.token_bytes, reply.tokens_held)

    def load_prefix(self, choice: PrefixChoice, sequence: str = "") -> PrefixLoaded:
        """Every rank takes the saved prefix as conversation `sequence`. PrefixGone: some rank no longer
        has it (or found its file unreadable); that conversation is then undefined until a reset."""
        request = pb.LoadPrefixRequest(prefix_id=choice.prefix_id, num_ranks=choice.num_ranks,
                                       tokens=choice.tokens, sequence=sequence)
        futures = [self._pool.submit(r.control.LoadPrefix, request, timeout=600, metadata=self.metadata)
                   for r in self.ranks]
        wait(futures)
        gone = []
        for r, f in zip(self.ranks, futures, strict=True):
            try:
                f.result()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise BackendError(self._describe(r, e, "a prefix load")) from None
                gone.append(f"{r.label}: {e.details()}")
        if gone:
            raise PrefixGone("; ".join(gone))
        replies = [f.result() for f in futures]
        return PrefixLoaded(max(r.keep_floor for r in replies), common_cuts([tuple(r.state_positions)
                                                                             for r in replies]))

    def cancel(self, request_id: str | None = None) -> None:
        """Ask every rank at once to abort the running request (or `request_id`)."""
        cancel_on(self.ranks, self.metadata, self._current_request if request_id is None else request_id)

    def unanswering(self, timeout: float = HEALTH_DEADLINE_S) -> list[tuple[RankHandle, grpc.RpcError]]:
        """Ranks that do not answer Health within timeout (all asked at once), in ring order."""
        return unanswering(self.ranks, self.metadata, timeout)

    def generate(self, generation: GenerationRequest) -> Iterator[GenerationEvent]:
        """Run one request on every rank; yield rank 0's events (progress, prefill,
        tokens, then done). A failing rank cancels the others and raises BackendError
        naming it and the phase; the survivors drop the request and stay usable."""
        if not self._lock.acquire(blocking=False):
            raise BackendError("a generation is already running on this cluster")
        try:
            request = generate_request(generation)
            self._current_request = request.request_id
            run = GenerationRun(self.ranks, self.metadata, self._pool, self._describe, request)
            self.last_results = run.watch.results
            yield from run.events()
        finally:
            self._current_request = ""
            self._lock.release()

    def step(self, rows: list[StepRow]) -> list[TokenOut]:
        """One decode step over several answers at once (each row's conversation reads its unread token):
        the token each samples. A failing rank raises BackendError naming it."""
        reply = step_on(self.ranks, self.metadata, self._pool, self._describe, step_request(rows))
        return [token_out(t) for t in reply.tokens]

    def stats_once(self) -> list[RankStats]:
        """Every rank's stats now, in rank order."""
        return self._each(lambda r: rank_stats(r, next(iter(r.control.Stats(
            pb.StatsRequest(once=True), timeout=10, metadata=self.metadata)))))

    def stats(self, interval_s: float = 0.25, stop: threading.Event | None = None) -> Iterator[RankStats]:
        """Merge the ranks' stats streams into RankStats snapshots; ends when every stream does
        (on close(), or once `stop` is set: that cancels the streams of a cluster that stays open)."""
        return merged_stats(self.ranks, self.metadata, self._describe, interval_s, stop or threading.Event(),
                            self._closed, self._stats_threads)
