"""The ring: a long-lived gRPC stream to the next rank, and a mailbox for
blocks arriving from the previous one.

Sending is asynchronous (a queue drained by gRPC's own thread), so the
engine computes on one block while the next travels. Tensors cross threads
as `HostTensor`s: only the engine's thread makes MLX arrays.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import mlx.core as mx

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.wire import BlockAssembler, BlockKey, FrameError, HostTensor, block_frames, to_host, to_mlx

_CLOSE = object()


class RingBroken(RuntimeError):
    """The link to a neighbour failed; the message names the neighbour."""


class Aborted(RuntimeError):
    """The running request was cancelled."""


class RingLink:
    """The stream from this rank to the next one in the ring."""

    def __init__(
        self,
        channel: grpc.Channel,
        ring_id: str,
        rank: int,
        peer: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.ring_id, self.rank, self.peer = ring_id, rank, peer
        self.error: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._channel = channel
        # Frames arrive already serialized (wire.block_frames), so no request serializer.
        self._link = channel.stream_unary("/cpchat.Ring/Link", response_deserializer=pb.LinkClosed.FromString)
        self._metadata = metadata
        self._thread = threading.Thread(target=self._run, name="ring-link", daemon=True)
        self._thread.start()

    def send(self, key: BlockKey, tensors: list[mx.array]) -> None:
        if self.error:
            raise RingBroken(self.error)
        mx.eval(*tensors)
        self._queue.put((key, [to_host(a) for a in tensors]))

    def close(self) -> None:
        self._queue.put(_CLOSE)

    def _frames(self) -> Iterator[pb.Frame]:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            key, tensors = item
            try:
                yield from block_frames(self.ring_id, key, self.rank, tensors)
            except Exception as e:  # gRPC would hide this behind "Exception iterating requests!"
                self.error = f"cannot send to next rank {self.peer}: {type(e).__name__}: {e}"
                raise

    def _run(self) -> None:
        try:
            self._link(self._frames(), metadata=self._metadata)
        except grpc.RpcError as e:
            self.error = self.error or f"link to next rank {self.peer} failed: {e.details() or e.code().name}"
        finally:
            self._channel.close()  # a closed or re-formed ring leaves no channel behind


class Mailbox:
    """Blocks from the previous rank, keyed by (request, layer, step, kind)."""

    def __init__(self, validate: Callable[[pb.Frame, int], None]) -> None:
        self._validate = validate
        self._cond = threading.Condition()
        self._partial: dict[BlockKey, BlockAssembler] = {}
        self._done: dict[BlockKey, list[HostTensor]] = {}
        self._dead: set[str] = set()
        self.error: str | None = None

    def put(self, frame: pb.Frame, data: memoryview) -> None:
        """Add one frame (header and data bytes); raises FrameError for a frame that does not fit."""
        self._validate(frame, len(data))
        key = BlockKey(frame.request_id, frame.layer, frame.step, frame.kind)
        with self._cond:
            if frame.request_id in self._dead:
                return
            if key in self._done:
                raise FrameError(f"block {key} arrived twice")
            assembler = self._partial.get(key)
            if assembler is None:
                assembler = self._partial[key] = BlockAssembler(frame)
            tensors = assembler.add(frame, data)
            if tensors is not None:
                del self._partial[key]
                self._done[key] = tensors
                self._cond.notify_all()

    def take(self, key: BlockKey, abort: threading.Event, link: RingLink | None = None) -> list[HostTensor]:
        """Wait for a block; raise Aborted or RingBroken instead of waiting forever."""
        with self._cond:
            while key not in self._done:
                if abort.is_set():
                    raise Aborted(key.request_id)
                if self.error:
                    raise RingBroken(self.error)
                if link is not None and link.error:
                    raise RingBroken(link.error)
                self._cond.wait(0.05)
            return self._done.pop(key)

    def fail(self, message: str) -> None:
        with self._cond:
            self.error = message
            self._cond.notify_all()

    def forget(self, request_id: str) -> None:
        """Drop every block of a finished or aborted request, now and later."""
        with self._cond:
            self._dead.add(request_id)
            for store in (self._partial, self._done):
                for key in [k for k in store if k.request_id == request_id]:
                    del store[key]


class Ring:
    """This rank's view of the ring: send to the next rank, take from the previous."""

    def __init__(self, rank: int, size: int, link: RingLink | None, mailbox: Mailbox) -> None:
        self.rank, self.size, self.link, self.mailbox = rank, size, link, mailbox

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size

    def send(self, key: BlockKey, tensors: list[mx.array]) -> None:
        assert self.link is not None, "a ring of one rank sends nothing"
        self.link.send(key, tensors)

    def take(self, key: BlockKey, abort: threading.Event) -> tuple[list[mx.array], float]:
        """The block, as MLX arrays made on the caller's thread, and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        tensors = self.mailbox.take(key, abort, self.link)
        waited = time.perf_counter() - t0
        return [to_mlx(t) for t in tensors], waited
