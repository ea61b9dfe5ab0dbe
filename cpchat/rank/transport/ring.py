"""The ring: a long-lived link from this rank to every other one (the ring
algorithms use the one to the next rank; all-gather, Ulysses and the one-step
decode exchange use them all), and a mailbox for the blocks that arrive, keyed
by their sender. A link is a gRPC stream, or shared memory to a rank on the
same host (cpchat/rank/transport/shm.py).

Sending is asynchronous (a queue drained by gRPC's own thread), so the
engine computes on one block while the next travels. Tensors cross threads
as `HostTensor`s: only the engine's thread computes on MLX arrays.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import grpc
import mlx.core as mx

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport.wire import (
    BlockAssembler,
    BlockKey,
    FrameError,
    HostTensor,
    block_frames,
    to_host,
    to_mlx,
)

_CLOSE = object()
# `cpchat bench --link-delay-ms`: every message this rank sends waits this long first (a slower network)
LINK_DELAY_ENV = "CPCHAT_BENCH_LINK_DELAY_MS"
LINK_DELAY_S = float(os.environ.get(LINK_DELAY_ENV) or 0) / 1000


class RingBroken(RuntimeError):
    """The link to a neighbour failed; the message names the neighbour."""


class Aborted(RuntimeError):
    """The running request was cancelled."""


class Link:
    """Blocks from this rank to one other rank, queued and sent by a thread of the link's own (gRPC's
    stream here, a shared-memory ring buffer in `shm.SharedMemoryLink`)."""

    transport = ""

    def __init__(self, ring_id: str, rank: int, peer: str) -> None:
        self.ring_id, self.rank, self.peer = ring_id, rank, peer
        self.error: str | None = None
        self._queue: queue.Queue = queue.Queue()

    def put(self, key: BlockKey, tensors: list[HostTensor]) -> None:
        """Queue a block (already in host memory) for sending."""
        self._queue.put((key, tensors))

    def close(self) -> None:
        self._queue.put(_CLOSE)

    def _blocks(self) -> Iterator[tuple[BlockKey, list[HostTensor]]]:
        """The queued blocks, until the link is closed."""
        while (item := self._queue.get()) is not _CLOSE:
            yield item


class RingLink(Link):
    """The gRPC stream from this rank to one other rank."""

    transport = "grpc"

    def __init__(
        self,
        channel: grpc.Channel,
        ring_id: str,
        rank: int,
        peer: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(ring_id, rank, peer)
        self._channel = channel
        # Frames arrive already serialized (wire.block_frames), so no request serializer.
        self._link = channel.stream_unary("/cpchat.Ring/Link", response_deserializer=pb.LinkClosed.FromString)
        self._metadata = metadata
        self._thread = threading.Thread(target=self._run, name="ring-link", daemon=True)
        self._thread.start()

    def _frames(self) -> Iterator[bytes]:
        for key, tensors in self._blocks():
            try:
                yield from block_frames(self.ring_id, key, self.rank, tensors)
            except Exception as e:  # gRPC would hide this behind "Exception iterating requests!"
                self.error = f"cannot send to rank {self.peer}: {type(e).__name__}: {e}"
                raise

    def _run(self) -> None:
        try:
            self._link(self._frames(), metadata=self._metadata)
        except grpc.RpcError as e:
            self.error = self.error or f"link to rank {self.peer} failed: {e.details() or e.code().name}"
        finally:
            self._channel.close()  # a closed or re-formed ring leaves no channel behind


class Inbox(Protocol):
    """Messages that only a thread waiting for a block reads (shm.SharedMemoryListener's)."""

    def wait(self, timeout: float) -> None:
        """Deliver what comes within `timeout`, returning early once something has, or on `wake`."""

    def wake(self) -> None: ...


class Mailbox:
    """Blocks from the other ranks, keyed by (request, layer, step, kind) and sender. Blocks come from
    the links' receiving threads, and from `inbox`, which `take` reads while it waits."""

    def __init__(self, validate: Callable[[pb.Frame, int], None], inbox: Inbox | None = None) -> None:
        self._validate = validate
        self._inbox = inbox
        self._readers: set[int] = set()  # threads reading the inbox in `take`
        self._cond = threading.Condition()
        self._partial: dict[tuple[BlockKey, int], BlockAssembler] = {}
        self._done: dict[tuple[BlockKey, int], list[HostTensor]] = {}
        self._dead: set[str] = set()
        self.error: str | None = None

    def put(self, frame: pb.Frame, data: memoryview, array: mx.array | None = None) -> None:
        """Add one frame (header and data bytes, and the MLX array they are a view of, if any);
        raises FrameError for a frame that does not fit."""
        self._validate(frame, len(data))
        key = (BlockKey(frame.request_id, frame.layer, frame.step, frame.kind), frame.source_rank)
        with self._cond:
            if frame.request_id in self._dead:
                return
            if key in self._done:
                raise FrameError(f"block {key[0]} from rank {key[1]} arrived twice")
            assembler = self._partial.get(key)
            if assembler is None:
                assembler = self._partial[key] = BlockAssembler(frame)
            tensors = assembler.add(frame, data, array)
            if tensors is not None:
                del self._partial[key]
                self._done[key] = tensors
                self._cond.notify_all()
                if self._readers - {threading.get_ident()}:
                    self._inbox.wake()

    def take(self, key: BlockKey, source: int, abort: threading.Event,
             links: Iterable[Link] = ()) -> list[HostTensor]:
        """Wait for `source`'s block; raise Aborted or RingBroken instead of waiting forever."""
        with self._cond:
            while (key, source) not in self._done:
                if abort.is_set():
                    raise Aborted(key.request_id)
                if self.error:
                    raise RingBroken(self.error)
                for link in links:
                    if link.error:
                        raise RingBroken(link.error)
                if self._inbox is None:
                    self._cond.wait(0.05)
                    continue
                reader = threading.get_ident()
                self._readers.add(reader)
                self._cond.release()
                try:
                    self._inbox.wait(0.05)
                finally:
                    self._cond.acquire()
                    self._readers.discard(reader)
            return self._done.pop((key, source))

    def fail(self, message: str) -> None:
        with self._cond:
            self.error = message
            self._cond.notify_all()
            if self._readers:
                self._inbox.wake()

    def forget(self, request_id: str) -> None:
        """Drop every block of a finished or aborted request, now and later."""
        with self._cond:
            self._dead.add(request_id)
            for store in (self._partial, self._done):
                for key in [k for k in store if k[0].request_id == request_id]:
                    del store[key]


class Ring:
    """This rank's view of the ring: links to the other ranks, and the mailbox of what they sent."""

    def __init__(self, rank: int, size: int, links: dict[int, Link], mailbox: Mailbox) -> None:
        self.rank, self.size, self.links, self.mailbox = rank, size, links, mailbox

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def peers(self) -> list[int]:
        """Every other rank, in rank order."""
        return [r for r in range(self.size) if r != self.rank]

    def send(self, key: BlockKey, tensors: list[mx.array], to: int | None = None) -> None:
        """Send a block to rank `to` (default: the next rank)."""
        self.send_all(key, tensors, [self.next_rank if to is None else to])

    def send_all(self, key: BlockKey, tensors: list[mx.array], to: Iterable[int]) -> None:
        """Send one block to several ranks; it is evaluated and copied to host memory once."""
        links = [self.links[r] for r in to]
        for link in links:
            if link.error:
                raise RingBroken(link.error)
        mx.eval(*tensors)
        host = [to_host(a) for a in tensors]
        for link in links:
            if LINK_DELAY_S:
                time.sleep(LINK_DELAY_S)
            link.put(key, host)

    def take(self, key: BlockKey, abort: threading.Event, source: int | None = None
             ) -> tuple[list[mx.array], float]:
        """A block from rank `source` (default: the previous rank), as MLX arrays made on the
        caller's thread, and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        source = self.prev_rank if source is None else source
        tensors = self.mailbox.take(key, source, abort, self.links.values())
        waited = time.perf_counter() - t0
        return [to_mlx(t) for t in tensors], waited

    def close(self) -> None:
        for link in self.links.values():
            link.close()
