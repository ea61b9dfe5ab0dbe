"""Links between ranks on one host through shared memory.

The sending rank owns a ring buffer per link: an anonymous memfd that it maps and hands to the
receiving rank over a Unix socket (SCM_RIGHTS). The memfd has no name, so nothing is left behind
when either process ends, SIGKILL included. Each chunk of a block (wire.block_chunks: at most
CHUNK_BYTES) is copied into the buffer once, and one small message on the socket carries its
`Frame` header and where its bytes lie. The receiver hands (header, bytes) to the mailbox, as the
gRPC link does, and answers with a credit that frees the chunk's space. Small chunks travel inside
the message itself.

Small blocks (a decode step's queries and partial outputs) take a second socket of the link, the
direct one, which no thread of the listener reads: the thread that waits for a block reads it itself
(`SharedMemoryListener.wait`, called by the mailbox), so a message wakes that thread and no other.
On a small VM each wake-up of a sleeping thread costs tens of microseconds before the first line of
Python runs again, and a lead step's layer crosses twice.

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
import select
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
HELLO_DIRECT = b"cpchat-shm-direct-1\0"  # the link's direct socket: small blocks, read by their taker
ACCEPTED = b"ok"
BYE = b"bye"  # the sender closed the link on purpose (a re-formed ring), not by dying
CHUNK = struct.Struct("<QQI")  # offset in the buffer (INLINE: after the header), length, header length
CREDIT = struct.Struct("<I")  # chunks freed, oldest first
INLINE = (1 << 64) - 1
MAX_MESSAGE = CHUNK.size + 64 * 1024 + INLINE_BYTES  # a header is well under 64 KiB
CONNECT_TIMEOUT_S = 5.0


def _address(endpoint: str) -> str:
    return "\0" + endpoint


def _inline(header: bytes, data: memoryview) -> list[bytes | memoryview]:
    """A chunk that carries its data with it: what a message (or a direct message, several of them
    one after the other) holds."""
    return [CHUNK.pack(INLINE, len(data), len(header)), header, data]


def _connect(endpoint: str, hello: bytes, fds: list[int], peer: str) -> socket.socket:
    """A socket to the listener at `endpoint` that accepted `hello` (and the descriptors `fds`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(_address(endpoint))
        socket.send_fds(sock, [hello], fds)
        if sock.recv(len(ACCEPTED)) != ACCEPTED:
            raise ConnectionRefusedError(f"rank {peer} refused a shared-memory link")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


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
        fd = os.memfd_create("cpchat-link", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            self._buffer = mmap.mmap(fd, capacity)
            self._sock = _connect(endpoint, HELLO + (token or "").encode(), [fd], peer)
        finally:
            os.close(fd)  # the receiver holds its own descriptor now, or none ever will
        try:
            self._direct = _connect(endpoint, HELLO_DIRECT + (token or "").encode(), [], peer)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="shm-link", daemon=True)
        self._thread.start()

    def put(self, key: BlockKey, tensors: list[HostTensor]) -> None:
        """A small block goes out at once, as one message on the direct socket, from the caller's
        thread (no hand-off to the link's, and one wake-up of the receiver: the latency of a decode
        step's messages), unless the socket is full (a receiver that has not waited for a block for a
        while): then the link's thread sends it, and the caller never waits on a peer. Larger blocks
        are queued. The mailbox keys blocks, so their order on the link does not matter."""
        if sum(t.data.nbytes for t in tensors) > INLINE_BYTES:
            super().put(key, tensors)
            return
        message = [part for header, data in block_chunks(self.ring_id, key, self.rank, tensors)
                   for part in _inline(header, data)]
        try:
            self._direct.sendmsg(message, [], socket.MSG_DONTWAIT)  # a whole message or none
        except BlockingIOError:
            self._queue.put(message)
        except OSError as e:
            self.error = f"link to rank {self.peer} failed: {e}"

    def _run(self) -> None:
        try:
            for block in self._blocks():
                if isinstance(block, list):  # a small block's message
                    self._direct.sendmsg(block)
                    continue
                for header, data in block_chunks(self.ring_id, block[0], self.rank, block[1]):
                    self._send_chunk(header, data)
            self._direct.send(BYE)
            self._sock.send(BYE)
            self._sock.settimeout(CONNECT_TIMEOUT_S)
            while self._sock.recv(CREDIT.size):  # read to the end: a socket closed with credits unread
                pass  # would reset the receiver's before it reads the goodbye
        except OSError as e:  # ConnectionError too
            self.error = f"link to rank {self.peer} failed: {e}"
        finally:
            self._direct.close()
            self._sock.close()
            self._buffer.close()

    def _send_chunk(self, header: bytes, data: memoryview) -> None:
        if len(data) <= INLINE_BYTES:
            self._sock.sendmsg(_inline(header, data))
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


@dataclass
class _Direct:
    """A link's direct socket, and the ring and rank its frames came from (once one has)."""

    sock: socket.socket
    ring_id: str | None = None
    source: int = 0


class SharedMemoryListener:
    """Accepts shared-memory links from ranks on this host. Each chunk that arrives goes to
    `deliver(frame, data)` (which raises FrameError for a frame that does not fit); `closed(ring_id,
    source)` is called when a link whose frames were all accepted ends without saying goodbye."""

    def __init__(self, token: str | None, deliver: Callable[[pb.Frame, memoryview, mx.array | None], None],
                 closed: Callable[[str, int], None]) -> None:
        self.endpoint = f"cpchat-{os.getpid()}-{secrets.token_hex(8)}"
        self._token = (token or "").encode()
        self._deliver, self._closed = deliver, closed
        self._direct: list[_Direct] = []
        self._lock = threading.Lock()  # guards _direct
        self._reading = threading.Lock()  # one thread reads the direct sockets at a time
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
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
        with self._lock:
            for direct in self._direct:
                direct.sock.close()
            self._direct.clear()

    def wait(self, timeout: float) -> None:
        """Deliver the messages that come on the direct sockets within `timeout`, returning once some
        have or `wake` is called. The mailbox calls it on the thread that waits for a block, so that
        the message wakes no other thread."""
        with self._reading:
            with self._lock:
                fds = [*(d.sock for d in self._direct), self._wake]
            try:
                ready = select.select(fds, [], [], timeout)[0]
            except (OSError, ValueError):  # a socket closed meanwhile (the listener's close)
                return
            if self._wake in ready:
                os.eventfd_read(self._wake)
            self._read_direct()

    def wake(self) -> None:
        """End a `wait` now (a block came another way, or a new direct socket did)."""
        os.eventfd_write(self._wake, 1)

    def _read_direct(self) -> None:
        with self._lock:
            direct = list(self._direct)
        for d in direct:
            while True:
                try:
                    message = d.sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    message = b""  # the sender died with messages unread
                if message == BYE or not message or not self._take_direct(d, message):
                    self._drop(d, said_goodbye=message == BYE)
                    break

    def _take_direct(self, d: _Direct, message: bytes) -> bool:
        """Deliver the chunks of one message of a direct socket; False for a bad frame (the link is
        cut)."""
        try:
            for frame, data in self._inline_chunks(message):
                self._deliver(frame, data, None)
                d.ring_id, d.source = frame.ring_id, frame.source_rank
        except ValueError as e:  # FrameError
            print(f"cpchat rank: cut a shared-memory link: bad frame: {e}", file=sys.stderr, flush=True)
            d.ring_id = None
            return False
        return True

    @staticmethod
    def _inline_chunks(message: bytes) -> Iterator[tuple[pb.Frame, memoryview]]:
        """The (frame header, data) of each chunk of a direct message, which carries them one after
        the other, each with its data."""
        view, at = memoryview(message), 0
        while at < len(view):
            if len(view) - at < CHUNK.size:
                raise FrameError("short shared-memory message")
            offset, length, header_length = CHUNK.unpack_from(view, at)
            start = at + CHUNK.size
            at = start + header_length + length
            if offset != INLINE or at > len(view):
                raise FrameError("a direct message's chunk does not fit it")
            yield _frame(view[start:start + header_length]), view[start + header_length:at]

    def _drop(self, d: _Direct, said_goodbye: bool) -> None:
        with self._lock:
            self._direct.remove(d)
        d.sock.close()
        if not said_goodbye and d.ring_id is not None:
            self._closed(d.ring_id, d.source)

    def _serve(self, conn: socket.socket) -> None:
        accepted = self._handshake(conn)
        if accepted == "direct":
            with self._lock:
                self._direct.append(_Direct(conn))
            self.wake()  # a thread waiting now waits on it too
            with contextlib.suppress(OSError):  # accepted once it is read: the sender may use it at once
                conn.sendall(ACCEPTED)
            return
        with conn:
            if accepted is None:
                return
            try:
                self._receive(conn, accepted)
            finally:
                try:
                    accepted.close()
                except BufferError:  # a view outlived the link (an exception's frame): unmapped when freed
                    pass

    def _handshake(self, conn: socket.socket) -> mmap.mmap | str | None:
        """The sender's ring buffer, mapped read-only, or "direct" for a link's direct socket, if the
        sender may link; None otherwise."""
        fds: list[int] = []
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            message, fds, _, _ = socket.recv_fds(conn, len(HELLO_DIRECT) + 4096, 1)
            hello = next((h for h in (HELLO, HELLO_DIRECT) if message.startswith(h)), None)
            if (uid != os.getuid() or hello is None
                    or not hmac.compare_digest(message[len(hello):], self._token)):
                return None
            if hello == HELLO_DIRECT:
                conn.settimeout(None)
                return None if fds else "direct"
            if len(fds) != 1:
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
        frame = _frame(message[CHUNK.size:end])
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


def _frame(header: bytes | memoryview) -> pb.Frame:
    try:
        return pb.Frame.FromString(header)
    except Exception as e:  # protobuf's DecodeError
        raise FrameError(f"malformed frame header: {e}") from None
