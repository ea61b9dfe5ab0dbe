"""Tensors between ranks through mx.distributed, with the gRPC link carrying only their headers.

A rank forms one `mx.distributed` group per process (mx.distributed caches its global group). The
links need send and recv between two ranks, which MLX's `ring` backend (TCP, any OS) has, for the
two ring neighbours only; the other pairs keep their shared-memory or gRPC link. MLX's `nccl`
backend has no send or recv (mlx 0.32, mlx/distributed/nccl/nccl.cpp: "Send not supported"), and
`jaccl` needs each host's RDMA device list: cpchat forms neither.

Each chunk of a block over INLINE_BYTES travels as its `Frame` header on the gRPC stream, with
`data_plane_bytes` and `data_plane_seq` set and no data, followed by its bytes through
`mx.distributed.send`; smaller ones (a decode step's) ride inside the gRPC frame as usual. The
receiver's stream handler takes the bytes with `recv` before it validates the header, and in
`data_plane_seq` order per sender, so that a refused frame or a link replaced by a new ring never
leaves bytes for the wrong receive. mx.distributed has no way to cancel a receive: a peer that
vanishes without closing its sockets leaves that handler waiting, while the engine, which waits on
the mailbox and on the gRPC links, reports the lost link as on every other transport. After a lost
peer the group is broken for good, and the rank refuses to join another ring on it.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport.ring import RingLink
from cpchat.rank.transport.wire import CHUNK_BYTES, FrameError, block_chunks, block_frame

BACKENDS = ("ring",)  # the mx.distributed backends cpchat forms, fastest first
FORM_TIMEOUT_S = 30.0  # for every rank to join the group (the front end waits longer)
TURN_TIMEOUT_S = 30.0  # for the chunks before this one; beyond it the group is out of step
INLINE_BYTES = 16 << 10  # chunks up to this size travel inside their gRPC frame
MAX_AHEAD = 64  # chunks a header may run ahead of its sender's earlier chunks (a link handing over)


def available_backends() -> list[str]:
    return [b for b in BACKENDS if mx.distributed.is_available(b)]


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"mx.distributed backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not mx.distributed.is_available(backend):
        raise ValueError(f"this rank's MLX has no {backend} backend")


def free_port(host: str) -> int:
    """A port that was free on `host` just now, for this rank's end of the group."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


class DataPlane:
    """This rank's place in an mx.distributed group, and the order of the chunks through it."""

    def __init__(self, backend: str, rank: int, addresses: Sequence[str]) -> None:
        check_backend(backend)
        self.backend, self.rank, self.addresses = backend, rank, list(addresses)
        self.size = len(addresses)
        self.broken: str | None = None
        self.bytes_sent = 0
        self._sent = [0] * self.size  # chunks sent to each rank, ever
        self._received = [0] * self.size  # chunks taken from each rank, ever
        self._turn = threading.Condition()
        self._streams = threading.local()  # MLX streams belong to the thread that made them
        self.group = _form(backend, rank, self.addresses)

    def same_group(self, backend: str, rank: int, addresses: Sequence[str]) -> bool:
        return (backend, rank, list(addresses)) == (self.backend, self.rank, self.addresses)

    def reaches(self, peer: int) -> bool:
        """Whether send and recv work between this rank and `peer` (ring neighbours, on `ring`)."""
        return peer in ((self.rank + 1) % self.size, (self.rank - 1) % self.size)

    def _stream(self) -> mx.Stream:
        if not hasattr(self._streams, "stream"):
            self._streams.stream = mx.new_stream(mx.cpu)
        return self._streams.stream

    def next_seq(self, peer: int) -> int:
        """The sequence number of the next chunk to `peer` (one link sends to it at a time)."""
        seq = self._sent[peer]
        self._sent[peer] += 1
        return seq

    def send(self, peer: int, data: memoryview) -> None:
        try:
            sent = mx.distributed.send(mx.array(np.frombuffer(data, np.uint8)), peer, group=self.group,
                                       stream=self._stream())
            mx.eval(sent)
            self.bytes_sent += len(data)
        except RuntimeError as e:
            self.broken = f"mx.distributed {self.backend} group broke: {e}"
            raise

    def receive(self, source: int, seq: int, nbytes: int) -> mx.array:
        """Chunk `seq` from `source` (as bytes), once the chunks before it have been taken."""
        if not (0 <= source < self.size and self.reaches(source)):
            raise FrameError(f"rank {source} cannot send through this rank's {self.backend} group")
        if not 0 < nbytes <= CHUNK_BYTES:
            raise FrameError(f"data-plane chunk of {nbytes} bytes outside 1..{CHUNK_BYTES}")
        with self._turn:
            if not self._received[source] <= seq <= self._received[source] + MAX_AHEAD:
                self.broken = (f"data-plane chunk {seq} from rank {source} when "
                               f"{self._received[source]} is next")
                raise FrameError(self.broken)
            if not self._turn.wait_for(lambda: self._received[source] == seq, TURN_TIMEOUT_S):
                self.broken = f"data-plane chunk {self._received[source]} from rank {source} never came"
                raise FrameError(self.broken)
        try:
            got = mx.distributed.recv((nbytes,), mx.uint8, source, group=self.group, stream=self._stream())
            mx.eval(got)
        except RuntimeError as e:
            self.broken = f"mx.distributed {self.backend} group broke: {e}"
            raise FrameError(self.broken) from None
        finally:
            with self._turn:
                self._received[source] += 1
                self._turn.notify_all()
        return got


def _form(backend: str, rank: int, addresses: list[str]) -> mx.distributed.Group:
    """Form the group from the ranks' addresses, as `mlx.launch` would through the environment.
    mx.distributed waits for every rank without end, so this waits FORM_TIMEOUT_S at most (the
    waiting thread stays behind, and the process cannot form a group any more)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hostfile:
        json.dump([[a] for a in addresses], hostfile)
    os.environ.update(MLX_RANK=str(rank), MLX_WORLD_SIZE=str(len(addresses)), MLX_HOSTFILE=hostfile.name)
    formed: list = []
    thread = threading.Thread(target=lambda: formed.append(_init(backend)), name="data-plane-form",
                              daemon=True)
    thread.start()
    thread.join(FORM_TIMEOUT_S)
    os.unlink(hostfile.name)
    if not formed:
        raise TimeoutError(f"not every rank joined within {FORM_TIMEOUT_S:.0f} s (can each reach "
                           f"the others' data-plane addresses {', '.join(addresses)}?)")
    group = formed[0]
    if isinstance(group, Exception):
        raise group
    if (group.rank(), group.size()) != (rank, len(addresses)):
        raise ValueError(f"this process already belongs to an mx.distributed group "
                         f"(rank {group.rank()} of {group.size()})")
    return group


def _init(backend: str) -> mx.distributed.Group | Exception:
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        return e


class DataPlaneLink(RingLink):
    """The link to a rank that `DataPlane` reaches: headers on the gRPC stream, bytes beside it."""

    transport = "mlx"

    def __init__(self, plane: DataPlane, peer_rank: int, *args, **kwargs) -> None:
        self._plane, self._peer_rank = plane, peer_rank
        super().__init__(*args, **kwargs)

    def _frames(self) -> Iterator[bytes]:
        for key, tensors in self._blocks():
            try:
                for header, data in block_chunks(self.ring_id, key, self.rank, tensors):
                    if len(data) <= INLINE_BYTES:  # a group's send costs more time than these bytes
                        yield block_frame(header, data)
                        continue
                    seq = self._plane.next_seq(self._peer_rank)
                    # Protobuf merges concatenated messages: the header gains the two fields.
                    follows = pb.Frame(data_plane_bytes=len(data), data_plane_seq=seq)
                    yield header + follows.SerializeToString()
                    self._plane.send(self._peer_rank, data)  # the receiver's recv follows the header
            except Exception as e:
                self.error = f"cannot send to rank {self.peer}: {type(e).__name__}: {e}"
                raise

    def close(self) -> None:
        """Close, and wait until the last chunk has gone: the next ring's link to the same rank
        must not send beside it."""
        super().close()
        self._thread.join(timeout=10)
