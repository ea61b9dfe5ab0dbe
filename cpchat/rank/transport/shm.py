"""Links between ranks on one host through shared memory.

The sending rank owns a ring buffer per link: an anonymous memfd that it maps and hands to the
receiving rank over a Unix socket (SCM_RIGHTS). The memfd has no name, so nothing is left behind
when either process ends, SIGKILL included. Each chunk of a block (wire.block_chunks: at most
CHUNK_BYTES) is copied into the buffer once, and one small message on the socket carries its
`Frame` header and where its bytes lie. The receiver hands (header, bytes) to the mailbox, as the
gRPC link does, and answers with a credit that frees the chunk's space. Small chunks travel inside
the message itself.

The socket lives in Linux's abstract namespace, which belongs to a network namespace: a peer
that can connect is on this host. The listener accepts a peer only if it runs as the same user
(SO_PEERCRED) and presents the cluster token.
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import secrets
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport.ring import Link
from cpchat.rank.transport.wire import CHUNK_BYTES, BlockKey, FrameError, HostTensor, block_chunks

CAPACITY = 64 << 20  # each link's ring buffer: 16 chunks in flight
MAX_CAPACITY = 1 << 30  # the largest buffer a listener maps
INLINE_BYTES = 16 << 10  # chunks up to this size travel inside their message
ALIGN = 64
HELLO = b"cpchat-shm-1\0"
ACCEPTED = b"ok"
BYE = b"bye"  # the sender closed the link on purpose (a re-formed ring), not by dying
CHUNK = struct.Struct("<QQI")  # offset in the buffer (INLINE: after the header), length, header length
CREDIT = struct.Struct("<I")  # chunks freed, oldest first
INLINE = (1 << 64) - 1
MAX_MESSAGE = CHUNK.size + 64 * 1024 + INLINE_BYTES  # a header is well under 64 KiB
CONNECT_TIMEOUT_S = 5.0


def _address(endpoint: str) -> str:
    return "\0" + endpoint


class SharedMemoryLink(Link):
    """The link from this rank to a rank on the same host; raises OSError if `endpoint` cannot be
    reached from here (another host) or refuses this rank."""

    transport = "shm"

    def __init__(self, endpoint: str, ring_id: str, rank: int, peer: str, token: str | None = None,
                 capacity: int = CAPACITY) -> None:
        super().__init__(ring_id, rank, peer)
        if capacity < CHUNK_BYTES + ALIGN:
            raise ValueError(f"a link's buffer must hold one chunk of {CHUNK_BYTES} bytes")
        self._capacity = capacity
        self._inflight: deque[tuple[int, int]] = deque()  # (start, end) of the chunks not yet freed
        self._head = 0  # where the next chunk goes if it fits
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = os.memfd_create("cpchat-link", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            self._buffer = mmap.mmap(fd, capacity)
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(_address(endpoint))
            socket.send_fds(sock, [HELLO + (token or "").encode()], [fd])
            if sock.recv(len(ACCEPTED)) != ACCEPTED:
                raise ConnectionRefusedError(f"rank {peer} refused a shared-memory link")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(fd)  # the receiver holds its own descriptor now, or none ever will
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="shm-link", daemon=True)
        self._thread.start()

    def put(self, key: BlockKey, tensors: list[HostTensor]) -> None:
        """A small block goes out at once from the caller's thread (no hand-off to the link's: the
        latency of a decode step's messages), unless the socket is full (a receiver that stopped
        reading): then the link's thread sends the rest, and the caller never waits on a peer.
        Larger blocks are queued. The mailbox keys blocks, so their order on the link does not
        matter."""
        if sum(t.data.nbytes for t in tensors) > INLINE_BYTES:
            super().put(key, tensors)
            return
        chunks = deque(block_chunks(self.ring_id, key, self.rank, tensors))  # all inline: no buffer space
        try:
            while chunks:
                self._send_chunk(*chunks[0], socket.MSG_DONTWAIT)
                chunks.popleft()
        except BlockingIOError:
            self._queue.put(chunks)
        except OSError as e:
            self.error = f"link to rank {self.peer} failed: {e}"

    def _run(self) -> None:
        try:
            for block in self._blocks():
                if not isinstance(block, deque):  # a block's chunks, or the rest of a small block's
                    block = block_chunks(self.ring_id, block[0], self.rank, block[1])
                for header, data in block:
                    self._send_chunk(header, data)
            self._sock.send(BYE)
            self._sock.settimeout(CONNECT_TIMEOUT_S)
            while self._sock.recv(CREDIT.size):  # read to the end: a socket closed with credits unread
                pass  # would reset the receiver's before it reads the goodbye
        except OSError as e:  # ConnectionError too
            self.error = f"link to rank {self.peer} failed: {e}"
        finally:
            self._sock.close()
            self._buffer.close()

    def _send_chunk(self, header: bytes, data: memoryview, flags: int = 0) -> None:
        if len(data) <= INLINE_BYTES:
            self._sock.sendmsg([CHUNK.pack(INLINE, len(data), len(header)), header, data], [], flags)
            return
        start = self._place(len(data))
        # numpy copies without the GIL, so the engine and the receiving thread run meanwhile.
        np.frombuffer(self._buffer, np.uint8, len(data), start)[:] = np.frombuffer(data, np.uint8)
        self._sock.sendmsg([CHUNK.pack(start, len(data), len(header)), header])

    def _place(self, size: int) -> int:
        """Where `size` bytes fit in the buffer, waiting for the receiver's credits while they do not."""
        size = -(-size // ALIGN) * ALIGN
        self._take_credits(wait=False)
        while (start := self._free_at(size)) is None:
            self._take_credits(wait=True)
        self._inflight.append((start, start + size))
        self._head = start + size
        return start

    def _free_at(self, size: int) -> int | None:
        if not self._inflight:
            return 0
        oldest, newest = self._inflight[0][0], self._inflight[-1][0]
        if newest >= oldest:  # in use: [oldest, head); free: [head, capacity) and [0, oldest)
            if self._head + size <= self._capacity:
                return self._head
            return 0 if size <= oldest else None
        return self._head if self._head + size <= oldest else None  # wrapped: free is [head, oldest)

    def _take_credits(self, wait: bool) -> None:
        flags = 0 if wait else socket.MSG_DONTWAIT
        while True:
            try:
                message = self._sock.recv(CREDIT.size, flags)
            except BlockingIOError:
                return
            if len(message) != CREDIT.size:
                raise ConnectionError("the receiving rank closed the link")
            for _ in range(CREDIT.unpack(message)[0]):
                self._inflight.popleft()
            flags = socket.MSG_DONTWAIT


class SharedMemoryListener:
    """Accepts shared-memory links from ranks on this host. Each chunk that arrives goes to
    `deliver(frame, data)` (which raises FrameError for a frame that does not fit); `closed(ring_id,
    source)` is called when a link whose frames were all accepted ends without saying goodbye."""

    def __init__(self, token: str | None, deliver: Callable[[pb.Frame, memoryview, mx.array | None], None],
                 closed: Callable[[str, int], None]) -> None:
        self.endpoint = f"cpchat-{os.getpid()}-{secrets.token_hex(8)}"
        self._token = (token or "").encode()
        self._deliver, self._closed = deliver, closed
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(_address(self.endpoint))
        self._sock.listen(64)
        threading.Thread(target=self._accept, name="shm-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="shm-receive", daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buffer = self._handshake(conn)
            if buffer is None:
                return
            try:
                self._receive(conn, buffer)
            finally:
                try:
                    buffer.close()
                except BufferError:  # a view outlived the link (an exception's frame): unmapped when freed
                    pass

    def _handshake(self, conn: socket.socket) -> mmap.mmap | None:
        """The sender's ring buffer, mapped read-only, if the sender may link; None otherwise."""
        fds: list[int] = []
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            message, fds, _, _ = socket.recv_fds(conn, len(HELLO) + 4096, 1)
            token = message[len(HELLO):]
            if (uid != os.getuid() or not message.startswith(HELLO) or len(fds) != 1
                    or not hmac.compare_digest(token, self._token)):
                return None
            size = os.fstat(fds[0]).st_size
            if not 0 < size <= MAX_CAPACITY:
                return None
            buffer = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
            conn.sendall(ACCEPTED)
            conn.settimeout(None)
            return buffer
        except OSError:
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def _receive(self, conn: socket.socket, buffer: mmap.mmap) -> None:
        ring_id, source = None, 0
        view = memoryview(buffer)
        try:
            while (message := conn.recv(MAX_MESSAGE)) != BYE:
                if not message:
                    break  # the sender is gone
                frame, data, array, shared = self._chunk(message, view)
                self._deliver(frame, data, array)
                del data
                if shared:
                    with contextlib.suppress(OSError):  # a sender that left: the next recv says how
                        conn.send(CREDIT.pack(1))
                ring_id, source = frame.ring_id, frame.source_rank
            else:
                ring_id = None  # said goodbye
        except ValueError as e:  # FrameError: a bad frame cuts this link only, as on gRPC
            print(f"cpchat rank: cut a shared-memory link: bad frame: {e}", file=sys.stderr, flush=True)
            ring_id = None
        except OSError:
            pass  # the sender is gone (a reset: it died with credits unread)
        finally:
            try:
                view.release()
            except BufferError:
                pass
            if ring_id is not None:
                self._closed(ring_id, source)

    @staticmethod
    def _chunk(message: bytes, view: memoryview) -> tuple[pb.Frame, memoryview, mx.array | None, bool]:
        """One message's frame header, its data (copied out of the shared buffer when the mailbox
        would keep it as it is: into MLX memory, the array that follows), and whether it used the
        buffer."""
        if len(message) < CHUNK.size:
            raise FrameError("short shared-memory message")
        offset, length, header_length = CHUNK.unpack_from(message)
        end = CHUNK.size + header_length
        if end > len(message) or length > CHUNK_BYTES:
            raise FrameError("shared-memory message does not fit its sizes")
        try:
            frame = pb.Frame.FromString(message[CHUNK.size:end])
        except Exception as e:  # protobuf's DecodeError
            raise FrameError(f"malformed frame header: {e}") from None
        if offset == INLINE:
            if len(message) - end != length:
                raise FrameError("inline data does not match its length")
            return frame, memoryview(message)[end:], None, False
        if offset + length > len(view):
            raise FrameError("chunk lies outside the shared buffer")
        data = view[offset : offset + length]
        if frame.chunk_count != 1:
            return frame, data, None, True  # the mailbox gathers the chunks into a buffer of its own
        # The mailbox keeps a one-chunk tensor's bytes as given, and the sender reuses this space:
        # copy them once, to where the engine will use them.
        array = mx.array(np.frombuffer(data, np.uint8))
        return frame, memoryview(np.asarray(array)), array, True
