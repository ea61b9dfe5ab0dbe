"""`cpchat rank`: the gRPC servicers, kept thin over `RankState`."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import psutil
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cpchat import blas
from cpchat.checkpoints import CheckpointError
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol import cpchat_pb2_grpc as pb_grpc
from cpchat.protocol.channel import SERVER_KEEPALIVE, TokenCheck
from cpchat.rank import batch_step
from cpchat.rank.calibration import MAX_PROBE_BYTES, PROBE_BYTES, Calibration, calibrate
from cpchat.rank.engine import BadRequest
from cpchat.rank.fit import UnsupportedModel
from cpchat.rank.measures import MeasureStore
from cpchat.rank.memory import free_bytes, reuse_freed_blocks
from cpchat.rank.model_load import KVFormatRefused
from cpchat.rank.prefix_cache import CacheMiss, PrefixStore
from cpchat.rank.stages import StagesRefused
from cpchat.rank.state import CONTROL_SERVICE, MAX_ID, MAX_MESSAGE, NotNow, RankState
from cpchat.rank.transport.data_plane import (
    available_backends,
    free_port,
)
from cpchat.rank.transport.ring import Aborted, RingBroken
from cpchat.rank.transport.shm import SharedMemoryListener
from cpchat.rank.transport.wire import FrameError, parse_frame

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    *SERVER_KEEPALIVE,
]
RING_SERVICE = pb.DESCRIPTOR.services_by_name["Ring"].full_name
_END = object()


def status_of(e: BadRequest) -> grpc.StatusCode:
    return grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, NotNow) else grpc.StatusCode.INVALID_ARGUMENT


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
                place = self.s.stage_place(request.stages, tuple(request.stage_layers))
                info = self.s.on_mlx(self.s.engine.load, request.model, kv_format, place)
            except UnsupportedModel as e:
                self.s.state = "ready" if self.s.engine.model is not None else "idle"  # the old model stays
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{e} (not supported for context parallelism)")
            except (CheckpointError, KVFormatRefused, StagesRefused) as e:  # a GGUF, --kv-bits, --stages
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
            pipeline_stage=info.place.stage, first_layer=info.place.first, end_layer=info.place.end,
            packed_layers=info.products.packed, float32_layers=info.products.float32,
            products_note=info.products.note,
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

    def Step(self, request, context):
        try:
            if len(request.step_id) > MAX_ID:
                raise BadRequest(f"step_id longer than {MAX_ID} characters")
            batch_step.check(self.s.engine, request, self.s.ring.size if self.s.ring else 1)
            abort = self.s.begin(request.step_id)
        except BadRequest as e:
            context.abort(status_of(e), str(e))
        context.add_callback(abort.set)
        try:
            tokens = self.s.on_mlx(batch_step.run, self.s.engine, request, self.s.ring, abort)
        except (RingBroken, Aborted) as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except Exception as e:  # noqa: BLE001 - named to the front end, as a Generate's are
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self.s.end()
        return pb.StepReply(tokens=tokens)

    def _done(self, cancelled: bool) -> pb.GenerateDone:
        engine = self.s.engine
        return pb.GenerateDone(
            kv_tokens=len(engine.kv), kv_bytes=engine.kv.nbytes, rss_bytes=psutil.Process().memory_info().rss,
            cached_tokens=engine.total_tokens, cancelled=cancelled,
            keep_floor=engine.keep_floor, state_bytes=engine.states.nbytes,
            state_positions=engine.state_positions,
            proposed=engine.speculated[0], accepted=engine.speculated[1],
            decode_steps=engine.speculated[2],
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

    @contextlib.contextmanager
    def _between_generations(self, context):
        """Hold the rank for a short request; FAILED_PRECONDITION while a generation runs."""
        if not self.s.busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rank is busy; cancel the generation first")
        try:
            yield
        finally:
            self.s.busy.release()

    def Reset(self, request, context):
        with self._between_generations(context):
            try:
                if self.s.engine.kv is not None:
                    self.s.on_mlx(self._reset, request)
            except BadRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ResetReply(kv_tokens=len(self.s.engine.kv) if self.s.engine.kv else 0)

    def _reset(self, request: pb.ResetRequest) -> None:
        engine = self.s.engine
        if request.every:
            engine.forget_all()
        elif request.keep_tokens:
            engine.use(request.sequence)
            engine.reset(request.keep_tokens)
        else:
            engine.release(request.sequence)

    def FindPrefixes(self, request, context):
        found = self.s.engine.find_prefixes(list(request.tokens))
        return pb.FindPrefixesReply(prefixes=[
            pb.SavedPrefix(prefix_id=f.prefix_id, num_ranks=f.num_ranks, shard=f.shard, tokens=f.tokens,
                           common=f.common, floor=f.floor, state_positions=f.state_positions) for f in found])

    def LoadPrefix(self, request, context):
        engine = self.s.engine
        with self._between_generations(context):
            try:
                if self.s.ring is None:
                    raise NotNow("this rank is not part of a ring yet (Configure first)")
                self.s.on_mlx(engine.load_prefix, request.prefix_id, request.num_ranks, request.tokens,
                              self.s.ring, request.sequence)
            except CacheMiss as e:
                context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            except BadRequest as e:
                context.abort(status_of(e), str(e))
        return pb.LoadPrefixReply(kv_tokens=len(engine.kv), keep_floor=engine.keep_floor,
                                  state_positions=engine.state_positions)

    def LoadDraft(self, request, context):
        with self._between_generations(context):
            try:
                draft = self.s.on_mlx(self.s.engine.load_draft, request.model)
            except BadRequest as e:
                context.abort(status_of(e), str(e))
        return pb.LoadDraftReply(weight_bytes=draft.weight_bytes, token_bytes=draft.token_bytes,
                                 tokens_held=len(draft.read))

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
    measures: MeasureStore | None = None,
    memory_limit: int | None = None,
) -> None:
    """Run a rank until Shutdown, SIGTERM, or the death of its parent. `cache`: where it saves prefixes
    (None: it never touches the disk for them); `measures`: where it keeps its models' measured costs
    (None: it measures at every load); `memory_limit`: bytes it may hold in all (None: what
    its device has)."""
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the rank's log
    reuse_freed_blocks()
    stop = threading.Event()
    state = RankState(token, tls_ca, memory_limit)
    state.engine.prefix.cache = cache
    if measures is not None:
        state.engine.measures = measures
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
