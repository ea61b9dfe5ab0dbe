"""The ranks' streams merged into one: a generation's events from every rank, watched by the ranks'
heartbeats, and their stats. A rank that fails or falls silent is named, with the phase it failed in."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

import grpc

from cpchat.client.events import RankStats
from cpchat.client.generation import GenerationDone, GenerationEvent, PrefillDone, RankDone
from cpchat.client.messages import generation_event, rank_done, rank_stats
from cpchat.client.ranks import RankHandle
from cpchat.core.stages import common_cuts
from cpchat.errors import BackendError, BadInput
from cpchat.protocol import cpchat_pb2 as pb

HEALTH_DEADLINE_S = 2.0
# During a generation every rank beats (Heartbeat) from a thread of its own, however busy its work:
# one silent for SILENCE_S has stopped (SIGSTOP, a frozen machine) and is named, slow or not.
BEAT_INTERVAL_S = 0.5
SILENCE_S = 3.0

Describe = Callable[..., str]  # ranks.describe_failure with the cluster's TLS setting


@dataclass
class RankResult:
    done: RankDone | None = None
    error: str | None = None


@dataclass
class GenerationWatch:
    """What a running generation knows about where it is, for error messages."""

    phase: str = "prefill"
    layer: int = 0
    tokens: int = 0
    failure: str | None = None
    refused: bool = False  # the ranks refused the request itself (INVALID_ARGUMENT): bad input
    results: dict[int, RankResult] = field(default_factory=dict)

    def where(self) -> str:
        if self.phase == "prefill" and self.layer:
            return f"prefill, layer {self.layer}"
        if self.phase == "decode":
            return f"decode, token {self.tokens + 1}"
        return self.phase


# What the stream readers and the health monitor tell the generation, besides rank 0's events.
@dataclass(frozen=True)
class RankPrefilled:
    rank: int
    ms: float
    stage_wait_ms: float = 0.0


@dataclass(frozen=True)
class RankFailed:
    message: str


@dataclass(frozen=True)
class LinkBroke:
    """A rank's ring link broke: the culprit may be a neighbour."""

    reporter: RankHandle
    error: grpc.RpcError


@dataclass(frozen=True)
class StreamEnded:
    rank: int


def unanswering(ranks: list[RankHandle], metadata, timeout: float = HEALTH_DEADLINE_S
                ) -> list[tuple[RankHandle, grpc.RpcError]]:
    """Ranks that do not answer Health within timeout (all asked at once), in ring order."""
    calls = [(r, r.control.Health.future(pb.HealthRequest(), timeout=timeout, metadata=metadata))
             for r in ranks]
    failed = []
    for r, call in calls:
        try:
            call.result()
        except grpc.RpcError as e:
            failed.append((r, e))
    return failed


def cancel_on(ranks: list[RankHandle], metadata, request_id: str) -> None:
    """Ask every rank at once to abort request `request_id` ("": whatever runs); a hung rank costs one
    deadline."""
    request = pb.CancelRequest(request_id=request_id)
    calls = [r.control.Cancel.future(request, timeout=2.0, metadata=metadata) for r in ranks]
    for call in calls:
        with contextlib.suppress(grpc.RpcError):
            call.result()


def step_on(ranks: list[RankHandle], metadata, pool: ThreadPoolExecutor, describe: Describe,
            request: pb.StepRequest) -> pb.StepReply:
    """A batched decode step on every rank at once; the first rank's reply (it samples). A rank that fails
    stops the others (they wait for its partials) and raises BackendError naming it."""
    calls = {pool.submit(r.control.Step, request, metadata=metadata): r for r in ranks}
    for call in as_completed(calls):
        try:
            call.result()
        except grpc.RpcError as e:
            cancel_on(ranks, metadata, request.step_id)
            calls[call].state = "failed"
            raise BackendError(describe(calls[call], e, "a decode step")) from None
    return next(iter(calls)).result()


class GenerationRun:
    """One request on every rank: every rank's stream read on a thread of its own, their heartbeats
    followed, rank 0's events passed on; a failing rank cancels the others, which drop the request and
    stay usable."""

    def __init__(self, ranks: list[RankHandle], metadata, pool: ThreadPoolExecutor, describe: Describe,
                 request: pb.GenerateRequest) -> None:
        self.ranks, self.metadata, self.pool, self.describe = ranks, metadata, pool, describe
        self.request = request
        self.watch = GenerationWatch()

    def events(self) -> Iterator[GenerationEvent]:
        """Rank 0's events (progress, prefill, tokens, then done); raises BackendError naming a failed
        rank and the phase, or BadInput when the ranks refused the request."""
        watch = self.watch
        events: queue.Queue = queue.Queue()
        finished = threading.Event()
        streams, monitor = [], None
        try:
            streams = [r.control.Generate(self.request, metadata=self.metadata) for r in self.ranks]
            readers = [self.pool.submit(self._read, r, s, events)
                       for r, s in zip(self.ranks, streams, strict=True)]
            monitor = threading.Thread(target=self._monitor, args=(finished, events), daemon=True)
            monitor.start()
            remaining = len(self.ranks)
            # Rank 0 reports its prefill (and first token) as soon as *it* is done; hold them until
            # every rank is, so prefill time and decode rate describe the whole ring.
            held: list[GenerationEvent] | None = None
            prefilled: dict[int, RankPrefilled] = {}
            while remaining:
                item = events.get()
                if isinstance(item, StreamEnded):
                    remaining -= 1
                elif isinstance(item, RankPrefilled):
                    prefilled[item.rank] = item
                elif isinstance(item, (RankFailed, LinkBroke)):
                    if watch.failure is None:
                        watch.failure = item.message if isinstance(item, RankFailed) else self._blame(
                            item.reporter, item.error)
                        self._abort_all(streams)
                elif isinstance(item, PrefillDone):
                    held = [item]
                elif held is not None:
                    held.append(item)
                else:
                    yield item
                if held is not None and len(prefilled) == len(self.ranks):
                    waits = tuple(prefilled[r].stage_wait_ms for r in sorted(prefilled))
                    held[0] = replace(held[0], ms=max(p.ms for p in prefilled.values()), stage_wait_ms=waits)
                    yield from held
                    held = None
            if held is not None and watch.failure is None:  # a rank stopped short of prefill (cancel)
                yield from held
            for f in readers:
                f.result()
            if watch.failure:
                raise (BadInput if watch.refused else BackendError)(watch.failure)
            dones = [r.done for r in watch.results.values() if r.done]
            yield GenerationDone(ring_done(watch.results[0].done, dones))
        finally:
            finished.set()
            if monitor is not None:
                monitor.join()  # its heartbeat streams are cancelled: no thread is left inside gRPC
            if watch.failure is None and any(s.is_active() for s in streams):
                self._abort_all(streams)  # the caller stopped reading early

    def _read(self, r: RankHandle, stream, events: queue.Queue) -> None:
        watch = self.watch
        result = watch.results.setdefault(r.rank, RankResult())
        r.state = "busy"
        try:
            for event in stream:
                which = event.WhichOneof("event")
                if which == "prefill":
                    events.put(RankPrefilled(r.rank, event.prefill.ms, event.prefill.stage_wait_ms))
                if which == "done":
                    result.done = rank_done(event.done)
                elif r.rank == 0:
                    if which == "prefill":
                        watch.phase = "decode"
                    elif which == "progress":
                        watch.layer = event.progress.layer
                    elif which == "token":
                        watch.tokens += 1
                    events.put(generation_event(event))
            r.state = "ready"
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.CANCELLED and watch.failure:
                r.state = "failed" if r.state == "failed" else "ready"
            elif code == grpc.StatusCode.ABORTED:  # its ring link broke: the culprit may be a neighbour
                r.state = "ready"
                events.put(LinkBroke(r, e))
            else:
                watch.refused = watch.refused or code == grpc.StatusCode.INVALID_ARGUMENT
                gone = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                r.state = "failed" if gone else "ready"
                result.error = self.describe(r, e, watch.where())
                events.put(RankFailed(result.error))
        finally:
            events.put(StreamEnded(r.rank))

    def _blame(self, reporter: RankHandle, error: grpc.RpcError) -> str:
        """A rank reported a broken ring link: name the rank that no longer answers, if any."""
        failed = unanswering(self.ranks, self.metadata)
        if failed:
            r, e = failed[0]
            r.state = "failed"
            return self.describe(r, e, self.watch.where())
        return self.describe(reporter, error, self.watch.where())

    def _monitor(self, finished: threading.Event, events: queue.Queue) -> None:
        """Follow every rank's heartbeat while the generation runs: a rank whose beats stop for
        SILENCE_S, or whose stream breaks, is named; one that is only slow keeps beating."""
        request = pb.HeartbeatRequest(interval_s=BEAT_INTERVAL_S)
        calls = [r.control.Heartbeat(request, metadata=self.metadata) for r in self.ranks]
        heard = {r.rank: time.monotonic() for r in self.ranks}
        lost: queue.Queue = queue.Queue()

        def follow(r: RankHandle, call) -> None:
            try:
                for _ in call:
                    heard[r.rank] = time.monotonic()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    lost.put((r, e))

        followers = [threading.Thread(target=follow, args=rc, daemon=True)
                     for rc in zip(self.ranks, calls, strict=True)]
        for t in followers:
            t.start()
        try:
            while not finished.wait(BEAT_INTERVAL_S / 2):
                silent = [r for r in self.ranks if time.monotonic() - heard[r.rank] > SILENCE_S]
                if not lost.empty() or silent:
                    r, e = lost.get() if not lost.empty() else (silent[0], None)
                    r.state = "failed"
                    where = self.watch.where()
                    events.put(RankFailed(self.describe(r, e, where) if e else
                                          f"{r.label} stopped answering during {where}"))
                    return
        finally:
            for call in calls:
                call.cancel()
            for t in followers:
                t.join()

    def _abort_all(self, streams) -> None:
        """Stop the request on every rank (their KV rolls back). Waits only for the survivors'
        answers, so that a Configure right after finds them idle or winding down."""
        survivors = [r.state != "failed" for r in self.ranks]
        for s in streams:
            s.cancel()
        request = pb.CancelRequest(request_id=self.request.request_id)
        calls = [r.control.Cancel.future(request, timeout=2.0, metadata=self.metadata) for r in self.ranks]
        for alive, call in zip(survivors, calls, strict=True):
            if alive:
                with contextlib.suppress(grpc.RpcError):
                    call.result()


def ring_done(first: RankDone, dones: list[RankDone]) -> RankDone:
    """Rank 0's end of a request (`first`), with what every rank allows next (pipeline stages differ in
    it: a stage's sliding windows and linear layers are its own): the highest keep floor, the cuts all
    allow."""
    return replace(first, keep_floor=max(d.keep_floor for d in dones),
                   state_positions=common_cuts([d.state_positions for d in dones]))


def merged_stats(ranks: list[RankHandle], metadata, describe: Describe, interval_s: float,
                 stop: threading.Event, closed: threading.Event,
                 threads: list[threading.Thread]) -> Iterator[RankStats]:
    """The ranks' stats streams merged into RankStats snapshots; ends when every stream does (once
    `closed` or `stop` is set: that cancels the streams). Its threads are added to `threads`, for
    the caller to join: no thread may still be inside gRPC when the interpreter exits."""
    out: queue.Queue = queue.Queue()
    calls: list[grpc.Future] = []

    def follow(r: RankHandle) -> None:
        try:
            call = r.control.Stats(pb.StatsRequest(interval_s=interval_s), metadata=metadata)
            calls.append(call)
            if stop.is_set():
                call.cancel()
            for s in call:
                out.put(rank_stats(r, s))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                r.state = "failed"
                out.put(RankStats(r.rank, r.address, "failed", error=describe(r, e)))
        out.put(None)

    def cancel_on_stop() -> None:
        while not (stop.wait(0.2) or closed.is_set()):
            pass
        for call in list(calls):
            call.cancel()

    started = [threading.Thread(target=follow, args=(r,), daemon=True) for r in ranks]
    started.append(threading.Thread(target=cancel_on_stop, daemon=True))
    threads += started
    for t in started:
        t.start()
    open_streams = len(ranks)
    while open_streams:
        item = out.get()
        if item is None:
            open_streams -= 1
            continue
        yield item
