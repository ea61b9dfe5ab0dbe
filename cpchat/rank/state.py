"""`RankState`: everything a rank knows — its place in the ring and the links to the others, its engine,
what runs now — and the checks of what the servicers hand it (a ring description, each frame)."""

from __future__ import annotations

import math
import resource
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import mlx.core as mx
import numpy as np
import psutil
from grpc_health.v1 import health, health_pb2

from cpchat import blas
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol.channel import open_channel, token_metadata
from cpchat.rank.engine import BadRequest, Engine
from cpchat.rank.stages import StagePlace, place_of
from cpchat.rank.transport.data_plane import DataPlane, DataPlaneLink, check_backend
from cpchat.rank.transport.ring import Link, Mailbox, Ring, RingLink
from cpchat.rank.transport.shm import SharedMemoryLink, SharedMemoryListener
from cpchat.rank.transport.wire import CHUNK_BYTES, DTYPES, MAX_BLOCK_BYTES, FrameError

MAX_MESSAGE = CHUNK_BYTES + (64 << 10)  # one chunk and its header
MAX_RING = 256  # ranks in one ring
MAX_ID = 128  # characters in a request or ring id
MAX_DIMS = 8
WIND_DOWN_S = 5.0  # how long Configure or Generate waits for an aborted request to roll back
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["Control"].full_name
# What grpc.health.v1.Health reports on: the whole server ("") and the Control service.
HEALTH_CHECKED = ("", CONTROL_SERVICE)
SERVING_STATES = frozenset({"ready", "busy"})  # a generation running is still serving
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
    elif f.kind == pb.HIDDEN:  # step: a position
        if f.layer >= layers:
            raise FrameError(f"layer {f.layer} outside the model's {layers} layers")
    elif f.kind not in (pb.TOKEN, pb.DRAFT, pb.PROBE, pb.NEW_KV):  # step: a token's index or position
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


class RankState:
    """Everything a rank knows: its place in the ring, its engine, what runs."""

    def __init__(self, token: str | None = None, tls_ca: bytes | None = None,
                 memory_limit: int | None = None) -> None:
        self.token = token
        self.tls_ca = tls_ca
        self.memory_limit = memory_limit  # bytes this process may hold in all (--memory-limit)
        self.engine = Engine(memory_limit=memory_limit)
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
        if not self._acquire():
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
                self.on_mlx(self.engine.forget_all)
            return [links[peer].transport if peer in links else "" for peer in range(len(addresses))]
        finally:
            self.busy.release()

    def stage_place(self, stages: int, counts: tuple[int, ...]) -> Callable[[int], StagePlace] | None:
        """Where this rank sits among `stages` pipeline stages of the ring (a function of the model's
        layer count); None for one stage before the rank is part of a ring."""
        stages = max(stages, 1)
        if self.ring is None and stages == 1 and not counts:
            return None
        if self.ring is None:
            raise NotNow("this rank is not part of a ring yet (Configure first)")
        rank, size = self.ring.rank, self.ring.size
        return lambda layers: place_of(rank, size, layers, stages, counts)  # refuses a split that cannot be

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

    def _acquire(self) -> bool:
        """Take the rank at once if idle; wait a little only for a request that is already
        aborting (its front end saw a failure, on this rank or another, and goes on right away)."""
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
        if not self._acquire():
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
        engine = self.engine
        tokens, kv_bytes, state_bytes = engine.parked.totals(engine) if engine.kv is not None else (0, 0, 0)
        return pb.RankStats(
            rank=self.rank,
            state=self.state,
            kv_tokens=tokens,
            kv_bytes=kv_bytes,
            rss_bytes=psutil.Process().memory_info().rss,
            mlx_active_bytes=mx.get_active_memory(),
            mlx_peak_bytes=mx.get_peak_memory(),
            peak_rss_bytes=peak_rss_bytes(),
            data_plane_bytes_sent=self.data_plane.bytes_sent if self.data_plane else 0,
            state_bytes=state_bytes,
            sequences=len(engine.parked) + bool(engine.total_tokens),
            algorithm=engine.last_algorithm,
            ring_steps=[
                pb.RingStep(layer=t.layer, step=t.step, compute_ms=t.compute_ms, wait_ms=t.wait_ms,
                            bytes_sent=t.bytes_sent)
                for t in self.engine.last_timings
            ],
        )


def blas_report() -> pb.Blas:
    """The BLAS in use, and the fix when a Linux CPU rank multiplies with the reference one."""
    info = blas.in_use()
    slow = info.reference and sys.platform == "linux" and mx.default_device() == mx.cpu
    return pb.Blas(name=info.name, version=info.version, library=info.library,
                   fix=blas.install_hint() if slow else "", threads=info.threads)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
