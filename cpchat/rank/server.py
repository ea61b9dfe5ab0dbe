"""`cpchat rank`: the gRPC servicers, kept thin over `RankState`."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import queue
import resource
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import mlx.core as mx
import numpy as np
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cpchat import blas
from cpchat.checkpoints import CheckpointError
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol import cpchat_pb2_grpc as pb_grpc
from cpchat.protocol.channel import SERVER_KEEPALIVE, TokenCheck, open_channel, token_metadata
from cpchat.rank.calibration import MAX_PROBE_BYTES, PROBE_BYTES, Calibration, calibrate
from cpchat.rank.engine import BadRequest, Engine
from cpchat.rank.fit import UnsupportedModel
from cpchat.rank.memory import free_bytes, reuse_freed_blocks
from cpchat.rank.model_load import KVFormatRefused
from cpchat.rank.prefix_cache import CacheMiss, PrefixStore
from cpchat.rank.transport.data_plane import (
    DataPlane,
    DataPlaneLink,
    available_backends,
    check_backend,
    free_port,
)
from cpchat.rank.transport.ring import Aborted, Link, Mailbox, Ring, RingBroken, RingLink
from cpchat.rank.transport.shm import SharedMemoryLink, SharedMemoryListener
from cpchat.rank.transport.wire import CHUNK_BYTES, DTYPES, MAX_BLOCK_BYTES, FrameError, parse_frame

MAX_MESSAGE = CHUNK_BYTES + (64 << 10)  # one chunk and its header
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    *SERVER_KEEPALIVE,
]
MAX_RING = 256  # ranks in one ring
MAX_ID = 128  # characters in a request or ring id
MAX_DIMS = 8
WIND_DOWN_S = 5.0  # how long Configure waits for an aborted request to roll back
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["Control"].full_name
RING_SERVICE = pb.DESCRIPTOR.services_by_name["Ring"].full_name
# What grpc.health.v1.Health reports on: the whole server ("") and the Control service.
HEALTH_CHECKED = ("", CONTROL_SERVICE)
SERVING_STATES = frozenset({"ready", "busy"})  # a generation running is still serving
_END = object()
# Frames of a ring pass: their layer must be the model's, their step inside the ring.
LAYER_KINDS = frozenset({pb.KV, pb.QUERY, pb.PARTIAL, pb.GATHER, pb.HEADS, pb.OUTPUT, pb.HALO, pb.STATE,
                         pb.SHARD})


class NotNow(BadRequest):
    """A well-formed request at the wrong moment (busy, not configured): FAILED_PRECONDITION."""


def check_ring(rank: int, addresses: list[str], ring_id: str) -> None:
    """Refuse a ring description this rank cannot act on, before anything changes."""
    if not 0 < len(addresses) <= MAX_RING:
        raise BadRequest(f"a ring has 1..{MAX_RING} ranks, got {len(addresses)} addresses")
    if rank >= len(addresses):
        raise BadRequest(f"rank {rank} is not in a ring of {len(addresses)}")
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or len(a) > 300 or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadRequest(f"bad rank address {a[:60]!r}: expected host:port")
    if len(ring_id) > MAX_ID:
        raise BadRequest(f"ring_id longer than {MAX_ID} characters")


def check_frame(f: pb.Frame, data_bytes: int, ring: Ring | None, ring_id: str, layers: int) -> None:
    """Refuse a frame whose header does not fit this ring, this model or the byte limits
    (before any of its bytes are kept)."""
    if ring is None or f.ring_id != ring_id:
        raise FrameError("frame for a ring this rank is not part of")
    if len(f.request_id) > MAX_ID:
        raise FrameError(f"request_id longer than {MAX_ID} characters")
    size = ring.size
    if f.source_rank >= size or f.source_rank == ring.rank:
        raise FrameError(f"source_rank {f.source_rank} is not another rank of the ring of {size}")
    if f.kind in LAYER_KINDS:
        if f.layer >= layers:
            raise FrameError(f"layer {f.layer} outside the model's {layers} layers")
        if f.step >= (2 * size if f.kind in (pb.PARTIAL, pb.QUERY) else size):  # decode: + N at odd positions
            raise FrameError(f"step {f.step} outside a ring of {size}")
    elif f.kind not in (pb.TOKEN, pb.PROBE, pb.NEW_KV):  # step: a token's index or position
        raise FrameError(f"unknown frame kind {f.kind}")
    if f.dtype not in DTYPES:
        raise FrameError(f"dtype {f.dtype!r} is not one of {', '.join(DTYPES)}")
    if len(f.shape) > MAX_DIMS:
        raise FrameError(f"{len(f.shape)} dimensions; at most {MAX_DIMS}")
    nbytes = math.prod(f.shape) * DTYPES[f.dtype][0].itemsize  # Python ints: no overflow
    if nbytes > MAX_BLOCK_BYTES:
        raise FrameError(f"tensor of {nbytes} bytes exceeds the {MAX_BLOCK_BYTES} byte limit")
    if data_bytes > CHUNK_BYTES:
        raise FrameError(f"frame of {data_bytes} bytes exceeds the {CHUNK_BYTES} byte chunk limit")


def ring_channel(address: str, tls_ca: bytes | None) -> grpc.Channel:
    """A new channel to another rank, for one link of one ring."""
    return open_channel(address, tls_ca, [("grpc.max_send_message_length", MAX_MESSAGE)])


def serving(state: str, model_loaded: bool) -> bool:
    """What standard gRPC health checks report: SERVING once a model is loaded and the rank is
    ready or generating; NOT_SERVING without a model, while one loads, and in any other state."""
    return model_loaded and state in SERVING_STATES


def status_of(e: BadRequest) -> grpc.StatusCode:
    return grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, NotNow) else grpc.StatusCode.INVALID_ARGUMENT


class RankState:
    """Everything a rank knows: its place in the ring, its engine, what runs."""

    def __init__(self, token: str | None = None, tls_ca: bytes | None = None,
                 memory_limit: int | None = None) -> None:
        self.token = token
        self.tls_ca = tls_ca
        self.memory_limit = memory_limit  # bytes this process may hold in all (--memory-limit)
        self.engine = Engine()
        self.rank = 0
        self.addresses: list[str] = []
        self.ring_id = ""
        self.ring: Ring | None = None
        self.shm: SharedMemoryListener | None = None  # set by serve(): links from ranks on this host
        self.data_plane: DataPlane | None = None  # an mx.distributed group, once a ring asks for one
        self.data_plane_port = 0  # set by serve(): where this rank's end of that group would listen
        self.data_plane_failed = ""  # why a group did not form: mx.distributed allows one try per process
        self.changed = threading.Condition()  # Stats streams send a state change as it happens
        self.changes = 0
        self._state = "idle"
        self.busy = threading.Lock()
        self.abort: threading.Event | None = None
        self.request_id = ""
        self.activity = ""  # what holds `busy`, for refusals
        self.calibrations = 0
        self.blas = blas_report()
        # Every MLX operation of the rank runs on this one thread: an array made lazily on one
        # thread cannot be evaluated on another (mlx-lm's RoPE tables, bfloat16 views, KV buffers).
        self.mlx = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.computes_on_cpu = self.on_mlx(mx.default_device) == mx.cpu
        # The standard health service, for grpcurl, Kubernetes probes and load balancers. A Watch
        # stream holds a server thread (as Stats does) so that `set` never waits on a watcher.
        self.health = health.HealthServicer(experimental_non_blocking=False)
        self._publish_health()

    def on_mlx(self, fn, *args):
        """Run fn on the MLX thread and wait for its result."""
        return self.mlx.submit(fn, *args).result()

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        with self.changed:
            self._state = value
            self.changes += 1
            self._publish_health()
            self.changed.notify_all()

    def _publish_health(self) -> None:
        up = serving(self._state, self.engine.model is not None)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_CHECKED:
            self.health.set(service, status)

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Wait until the state has changed since `seen` changes, or timeout; the count now."""
        with self.changed:
            self.changed.wait_for(lambda: self.changes != seen, timeout)
            return self.changes

    # ---- ring

    def configure(self, rank: int, addresses: list[str], ring_id: str, shm_endpoints: Sequence[str] = (),
                  data_plane_backend: str = "", data_plane_addresses: Sequence[str] = ()) -> list[str]:
        """Join the ring; returns how this rank sends to each rank ("mlx", "shm", "grpc", "" for itself)."""
        check_ring(rank, addresses, ring_id)
        if shm_endpoints and len(shm_endpoints) != len(addresses):
            raise BadRequest(f"{len(shm_endpoints)} shared-memory endpoints for {len(addresses)} ranks")
        if data_plane_backend:
            if len(data_plane_addresses) != len(addresses):
                raise BadRequest(f"{len(data_plane_addresses)} data-plane addresses for "
                                 f"{len(addresses)} ranks")
            try:
                check_backend(data_plane_backend)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        if not self._acquire_for_configure():
            raise NotNow(f"rank is busy with {self.activity}; it cannot join a new ring until that ends")
        try:
            plane = self._join_data_plane(data_plane_backend, rank, data_plane_addresses)
            if self.ring:
                self.ring.close()
            self.rank, self.addresses, self.ring_id = rank, list(addresses), ring_id or uuid.uuid4().hex
            links = {
                peer: self._link(peer, address, shm_endpoints[peer] if shm_endpoints else "", plane)
                for peer, address in enumerate(addresses) if peer != rank
            }
            self.ring = Ring(rank, len(addresses), links, Mailbox(self.validate_frame, self.shm))
            self.calibrations = 0  # probe ids must agree across the ring, a replacement rank included
            if self.engine.kv is not None:
                self.on_mlx(self.engine.reset, 0)
            return [links[peer].transport if peer in links else "" for peer in range(len(addresses))]
        finally:
            self.busy.release()

    def _join_data_plane(self, backend: str, rank: int, addresses: Sequence[str]) -> DataPlane | None:
        """The mx.distributed group the ring asks for: formed now, or the one this process formed
        before (mx.distributed forms one per process)."""
        if not backend:
            return None
        plane = self.data_plane
        if self.data_plane_failed:
            raise BadRequest(f"{self.data_plane_failed}; restart the rank to form another")
        if plane is None:
            try:
                plane = self.data_plane = DataPlane(backend, rank, addresses)
            except (ValueError, RuntimeError, TimeoutError) as e:
                self.data_plane_failed = f"the mx.distributed {backend} group did not form: {e}"
                raise BadRequest(self.data_plane_failed) from None
        elif plane.broken:
            raise BadRequest(f"{plane.broken}; restart the rank to form another")
        elif not plane.same_group(backend, rank, addresses):
            raise BadRequest("this rank already belongs to another mx.distributed group, and "
                             "mx.distributed forms one per process: restart the rank")
        return plane

    def _link(self, peer: int, address: str, shm_endpoint: str, plane: DataPlane | None) -> Link:
        """The data plane where it reaches `peer`; else shared memory to a rank whose endpoint this
        rank can reach (one on this host); else gRPC."""
        if plane is not None and plane.reaches(peer):
            return DataPlaneLink(plane, peer, ring_channel(address, self.tls_ca), self.ring_id, self.rank,
                                 address, token_metadata(self.token))
        if shm_endpoint:
            try:
                return SharedMemoryLink(shm_endpoint, self.ring_id, self.rank, address, self.token)
            except OSError:
                pass  # on another host (or network namespace)
        return RingLink(ring_channel(address, self.tls_ca), self.ring_id, self.rank, address,
                        token_metadata(self.token))

    def _acquire_for_configure(self) -> bool:
        """Take the rank at once if idle; wait a little only for a request that is already
        aborting (its front end saw a failure and will re-form the ring right away)."""
        if self.busy.acquire(blocking=False):
            return True
        abort = self.abort
        return abort is not None and abort.is_set() and self.busy.acquire(timeout=WIND_DOWN_S)

    def validate_frame(self, f: pb.Frame, data_bytes: int) -> None:
        """The mailbox's check of each frame that arrives: `check_frame` against the ring now."""
        layers = self.engine.info.num_layers if self.engine.info else 0
        check_frame(f, data_bytes, self.ring, self.ring_id, layers)

    def receive(self, frame: pb.Frame, data: memoryview, array: mx.array | None = None) -> None:
        """One frame from a link (its bytes, and the MLX array they are a view of if the link made
        one); raises FrameError (or NotNow) for one that does not fit. A chunk whose bytes follow on
        the data plane takes them first, valid or not (data_plane.py)."""
        if frame.data_plane_bytes:
            if self.data_plane is None or len(data):
                raise FrameError("data-plane chunk on a rank without a data plane, or with inline data")
            array = self.data_plane.receive(frame.source_rank, frame.data_plane_seq, frame.data_plane_bytes)
            data = memoryview(np.asarray(array))
        if self.ring is None:
            raise FrameError("this rank is not part of a ring")
        self.ring.mailbox.put(frame, data, array)

    def link_closed(self, ring_id: str, source: int) -> None:
        if self.ring is not None and ring_id == self.ring_id:
            self.ring.mailbox.fail(f"link from rank {source} ({self.addresses[source]}) closed")

    # ---- requests

    def begin(self, request_id: str) -> threading.Event:
        if self.ring is None:
            raise NotNow("this rank is not part of a ring yet (Configure first)")
        if not self.busy.acquire(blocking=False):
            raise NotNow(f"rank is busy with {self.activity}; one generation at a time")
        self.abort, self.request_id, self.state = threading.Event(), request_id, "busy"
        self.activity = f"request {request_id}"
        return self.abort

    def end(self) -> None:
        self.state = "ready"
        self.busy.release()

    def cancel(self, request_id: str) -> bool:
        abort = self.abort
        if abort is None or (request_id and request_id != self.request_id) or not self.busy.locked():
            return False
        abort.set()
        return True

    def stats(self) -> pb.RankStats:
        kv = self.engine.kv
        return pb.RankStats(
            rank=self.rank,
            state=self.state,
            kv_tokens=len(kv) if kv else 0,
            kv_bytes=kv.nbytes if kv else 0,
            rss_bytes=psutil.Process().memory_info().rss,
            mlx_active_bytes=mx.get_active_memory(),
            mlx_peak_bytes=mx.get_peak_memory(),
            peak_rss_bytes=peak_rss_bytes(),
            data_plane_bytes_sent=self.data_plane.bytes_sent if self.data_plane else 0,
            state_bytes=self.engine.states.nbytes,
            algorithm=self.engine.last_algorithm,
            ring_steps=[
                pb.RingStep(layer=t.layer, step=t.step, compute_ms=t.compute_ms, wait_ms=t.wait_ms,
                            bytes_sent=t.bytes_sent)
                for t in self.engine.last_timings
            ],
        )


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, state: RankState, stop: threading.Event) -> None:
        self.s, self.stop = state, stop

    def Configure(self, request, context):
        try:
            transports = self.s.configure(request.rank, list(request.addresses), request.ring_id,
                                          list(request.shm_endpoints), request.data_plane_backend,
                                          list(request.data_plane_addresses))
        except BadRequest as e:
            context.abort(status_of(e), str(e))
        return pb.ConfigureReply(transports=transports)

    def LoadModel(self, request, context):
        if not self.s.busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"rank is busy with {self.s.activity}; cannot load a model now")
        try:
            self.s.activity, self.s.state = "loading a model", "loading"
            yield pb.LoadProgress(stage="loading")
            try:
                kv_format = KVFormat(request.kv_bits, request.kv_group_size or FULL_PRECISION.group_size,
                                     request.quantized_kv_start)
                info = self.s.on_mlx(self.s.engine.load, request.model, kv_format,
                                     free_bytes(self.s.memory_limit))
            except UnsupportedModel as e:
                self.s.state = "ready" if self.s.engine.model is not None else "idle"  # the old model stays
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{e} (not supported for context parallelism)")
            except (CheckpointError, KVFormatRefused) as e:  # a GGUF that cannot be converted, or --kv-bits
                self.s.state = "ready" if self.s.engine.model is not None else "idle"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:  # noqa: BLE001 - any load failure is reported, not raised
                self.s.state = "ready" if self.s.engine.model is not None else "idle"
                context.abort(grpc.StatusCode.NOT_FOUND, f"cannot load model {request.model!r}: {e}")
        finally:
            self.s.busy.release()
        self.s.state = "ready"
        yield pb.LoadProgress(
            stage="ready", model_type=info.model_type, num_layers=info.num_layers,
            num_q_heads=info.num_q_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
            vocab_size=info.vocab_size, bytes_per_element=info.bytes_per_element,
            max_context=info.max_context, value_dim=info.first_attention.value_dim,
            state_layers=len(info.linear), kv_bits=info.kv_format.bits,
            kv_group_size=info.kv_format.group_size, weight_bytes=self.s.engine.weight_bytes,
        )

    def Calibrate(self, request, context):
        try:
            probe = min(request.probe_bytes or PROBE_BYTES, MAX_PROBE_BYTES)
            if self.s.ring is None:
                raise NotNow("this rank is not part of a ring yet (Configure first)")
            c = self.s.on_mlx(self._calibrate, probe, min(request.rounds, 20) or 3)
        except (RingBroken, Aborted) as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except BadRequest as e:
            context.abort(status_of(e), str(e))
        return pb.CalibrateReply(flops_per_s=c.flops_per_s, ring_bytes_per_s=min(c.ring_bytes_per_s, 1e15),
                                 prefill_fixed_s=c.prefill.fixed_s, prefill_per_token_s=c.prefill.per_token_s,
                                 prefill_per_pair_s=c.prefill.per_pair_s, decode_step_s=c.prefill.step_s,
                                 prefill_per_masked_pair_s=c.prefill.per_masked_pair_s,
                                 link_latency_s=c.link_latency_s,
                                 exchange_latency_s=c.exchange_latency_s,
                                 forward_fixed_bytes=self.s.engine.forward_memory.fixed_bytes,
                                 forward_per_token_bytes=self.s.engine.forward_memory.per_token_bytes)

    def _calibrate(self, probe_bytes: int, rounds: int) -> Calibration:
        """On the MLX thread, one calibration at a time: probe ids count up per ring, alike on every rank."""
        request_id = f"calibrate-{self.s.ring_id}-{self.s.calibrations}"
        self.s.calibrations += 1
        return calibrate(self.s.ring, request_id, self.s.engine.prefill_cost, probe_bytes, rounds)

    def Generate(self, request, context):
        try:
            if len(request.request_id) > MAX_ID - 2:  # earlier passes send frames as ID#0, ID#1
                raise BadRequest(f"request_id longer than {MAX_ID - 2} characters")
            ranks = self.s.ring.size if self.s.ring else 1
            self.s.engine.validate(request, ranks)  # a malformed request never takes the rank
            abort = self.s.begin(request.request_id)
        except BadRequest as e:
            context.abort(status_of(e), str(e))
        events: queue.Queue = queue.Queue()
        context.add_callback(abort.set)  # the front end went away

        def work() -> None:
            try:
                self.s.engine.generate(request, self.s.ring, abort, events.put)
                events.put(_END)
            except BaseException as e:  # noqa: BLE001 - handed to the RPC thread
                events.put(e)
            finally:
                self.s.end()

        self.s.mlx.submit(work)
        while True:
            item = events.get()
            if item is _END or isinstance(item, Aborted):
                yield pb.GenerateEvent(done=self._done(cancelled=item is not _END))
                return
            if isinstance(item, BadRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, RingBroken):
                context.abort(grpc.StatusCode.ABORTED, str(item))
            if isinstance(item, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"{type(item).__name__}: {item}")
            yield item

    def _done(self, cancelled: bool) -> pb.GenerateDone:
        kv = self.s.engine.kv
        return pb.GenerateDone(
            kv_tokens=len(kv), kv_bytes=kv.nbytes, rss_bytes=psutil.Process().memory_info().rss,
            cached_tokens=self.s.engine.total_tokens, cancelled=cancelled,
            keep_floor=self.s.engine.keep_floor, state_bytes=self.s.engine.states.nbytes,
            state_positions=self.s.engine.state_positions,
        )

    def Cancel(self, request, context):
        return pb.CancelReply(cancelled=self.s.cancel(request.request_id))

    def Stats(self, request, context):
        interval = min(max(request.interval_s or 0.25, 0.05), 10.0)
        last, changes = None, self.s.changes
        while context.is_active() and not self.stop.is_set():
            snapshot = self.s.stats()
            if snapshot != last:
                yield snapshot
                last = snapshot
            if request.once:
                return
            changes = self.s.wait_for_change(changes, interval)

    def Reset(self, request, context):
        if not self.s.busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rank is busy; cancel the generation first")
        try:
            if self.s.engine.kv is not None:
                self.s.on_mlx(self.s.engine.reset, request.keep_tokens)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.s.busy.release()
        return pb.ResetReply(kv_tokens=len(self.s.engine.kv) if self.s.engine.kv else 0)

    def FindPrefixes(self, request, context):
        found = self.s.engine.find_prefixes(list(request.tokens))
        return pb.FindPrefixesReply(prefixes=[
            pb.SavedPrefix(prefix_id=f.prefix_id, num_ranks=f.num_ranks, shard=f.shard, tokens=f.tokens,
                           common=f.common, floor=f.floor, state_positions=f.state_positions) for f in found])

    def LoadPrefix(self, request, context):
        if not self.s.busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rank is busy; cancel the generation first")
        try:
            if self.s.ring is None:
                raise NotNow("this rank is not part of a ring yet (Configure first)")
            engine = self.s.engine
            self.s.on_mlx(engine.load_prefix, request.prefix_id, request.num_ranks, request.tokens,
                          self.s.ring)
        except CacheMiss as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except BadRequest as e:
            context.abort(status_of(e), str(e))
        finally:
            self.s.busy.release()
        return pb.LoadPrefixReply(kv_tokens=len(engine.kv), keep_floor=engine.keep_floor,
                                  state_positions=engine.state_positions)

    def Health(self, request, context):
        return pb.HealthReply(state=self.s.state, rank=self.s.rank, pid=os.getpid(), blas=self.s.blas,
                              shm_endpoint=self.s.shm.endpoint if self.s.shm else "",
                              cpu_cores=len(os.sched_getaffinity(0)),
                              computes_on_cpu=self.s.computes_on_cpu,
                              data_plane_backends=available_backends(),
                              data_plane_port=self.s.data_plane_port,
                              memory_free_bytes=free_bytes(self.s.memory_limit),
                              cpu_allowance=blas.cpu_allowance())

    def Heartbeat(self, request, context):
        interval = min(max(request.interval_s, 0.05), 5.0)
        seq = 0
        while context.is_active() and not self.stop.is_set():
            yield pb.Beat(seq=seq)
            seq += 1
            self.stop.wait(interval)

    def Shutdown(self, request, context):
        self.s.engine.prefix.flush()  # the prefix files being written are finished first
        self.stop.set()
        return pb.ShutdownReply()


def blas_report() -> pb.Blas:
    """The BLAS in use, and the fix when a Linux CPU rank multiplies with the reference one."""
    info = blas.in_use()
    slow = info.reference and sys.platform == "linux" and mx.default_device() == mx.cpu
    return pb.Blas(name=info.name, version=info.version, library=info.library,
                   fix=blas.install_hint() if slow else "", threads=info.threads)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RingServicer(pb_grpc.RingServicer):
    def __init__(self, state: RankState) -> None:
        self.s = state

    def Link(self, request_iterator, context):
        """Frames from another rank. Only a stream whose frames were all accepted counts as
        a link of the ring: one that sent a bad frame is cut, and its end breaks nothing else."""
        ring_id, source = None, 0
        try:
            for raw in request_iterator:
                if self.s.ring is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this rank is not part of a ring")
                try:
                    frame, data = parse_frame(raw)
                    self.s.receive(frame, data)
                except (FrameError, ValueError) as e:
                    ring_id = None
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad frame: {e}")
                ring_id, source = frame.ring_id, frame.source_rank
        finally:
            if ring_id is not None and not context.is_active():
                self.s.link_closed(ring_id, source)
        return pb.LinkClosed()


def add_ring_servicer(servicer: RingServicer, server: grpc.Server) -> None:
    """As the generated `add_RingServicer_to_server`, but frames reach `Link` as raw bytes
    (`parse_frame` takes their data without the copies protobuf's parser makes)."""
    link = grpc.stream_unary_rpc_method_handler(
        servicer.Link, response_serializer=pb.LinkClosed.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RING_SERVICE, {"Link": link}),))


def add_probe_services(state: RankState, server: grpc.Server) -> None:
    """The standard grpc.health.v1.Health and server reflection, for grpcurl, Kubernetes probes and
    load balancers; behind the token like every other RPC."""
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    reflection.enable_server_reflection(
        (CONTROL_SERVICE, RING_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )


def serve(
    host: str,
    port: int,
    token: str | None = None,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    tls_ca: bytes | None = None,
    parent_pid: int | None = None,
    cache: PrefixStore | None = None,
    memory_limit: int | None = None,
) -> None:
    """Run a rank until Shutdown, SIGTERM, or the death of its parent. `cache`: where it saves prefixes
    (None: it never touches the disk for them); `memory_limit`: bytes it may hold in all (None: what
    its device has)."""
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the rank's log
    reuse_freed_blocks()
    stop = threading.Event()
    state = RankState(token, tls_ca, memory_limit)
    state.engine.prefix.cache = cache
    state.shm = SharedMemoryListener(token, state.receive, state.link_closed)
    state.data_plane_port = free_port(host)
    interceptors = [TokenCheck(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=SERVER_OPTIONS,
                         interceptors=interceptors)
    pb_grpc.add_ControlServicer_to_server(ControlServicer(state, stop), server)
    add_ring_servicer(RingServicer(state), server)
    add_probe_services(state, server)
    address = f"{host}:{port}"
    if tls_cert and tls_key:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot listen on {address}")
    server.start()
    print(json.dumps({"event": "listening", "address": f"{host}:{bound}", "pid": os.getpid()}), flush=True)
    if parent_pid:
        args = (parent_pid, stop, state.engine.prefix.flush)
        threading.Thread(target=_watch_parent, args=args, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a clean stop: the prefix files being written end
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    state.health.enter_graceful_shutdown()  # NOT_SERVING for the grace period, to balancers
    server.stop(grace=0.5).wait()
    state.engine.prefix.flush()
    state.shm.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing is left to do, and the interpreter's teardown of MLX's threads can abort


def _watch_parent(parent_pid: int, stop: threading.Event, flush: Callable[[], None]) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            with contextlib.suppress(OSError):  # stderr may have gone with the parent (an ssh session)
                sys.stderr.write("cpchat rank: front end is gone, exiting\n")
            flush()  # the prefix files being written are finished (a generation under way is not)
            os._exit(0)
        time.sleep(0.5)
