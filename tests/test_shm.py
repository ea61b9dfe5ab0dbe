"""Shared-memory links (cpchat/rank/transport/shm.py) with real sockets and memfds, across real
processes where a process has to die or be someone else."""

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport import shm
from cpchat.rank.transport.ring import Mailbox, RingBroken
from cpchat.rank.transport.shm import SharedMemoryLink, SharedMemoryListener
from cpchat.rank.transport.wire import CHUNK_BYTES, BlockKey, HostTensor, to_host, to_mlx

TOKEN = "s3cret"


class Receiver:
    """A listener whose chunks go to a mailbox, and the links it saw end."""

    def __init__(self, token: str | None = TOKEN) -> None:
        self.closed: list[tuple[str, int]] = []
        self.ended = threading.Event()
        self.listener = SharedMemoryListener(token, lambda *chunk: self.mailbox.put(*chunk), self._closed)
        self.mailbox = Mailbox(lambda frame, size: None, self.listener)

    def _closed(self, ring_id: str, source: int) -> None:
        self.closed.append((ring_id, source))
        self.ended.set()

    def take(self, key: BlockKey, source: int = 1) -> list[mx.array]:
        return [to_mlx(t) for t in self.take_host(key, source)]

    def take_host(self, key: BlockKey, source: int = 1) -> list[HostTensor]:
        abort = threading.Event()
        timer = threading.Timer(30, abort.set)
        timer.start()
        try:
            return self.mailbox.take(key, source, abort)
        finally:
            timer.cancel()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.listener.close()


def key(step: int) -> BlockKey:
    return BlockKey("req", 0, step, pb.KV)


def test_blocks_of_every_size_arrive_bit_exact(receiver):
    link = SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", TOKEN)
    blocks = [
        [mx.arange(4, dtype=mx.float32)],  # inside the message
        [mx.random.normal((256, 1024)).astype(mx.bfloat16)],  # one chunk in the buffer
        [mx.random.normal((3, CHUNK_BYTES // 4 + 7)), mx.arange(5, dtype=mx.int32)],  # several chunks
        [mx.zeros((0,), mx.float32)],
    ]
    for step, block in enumerate(blocks):
        link.put(key(step), [to_host(a) for a in block])
    for step, block in enumerate(blocks):
        got = receiver.take(key(step))
        assert [(g.dtype, g.shape) for g in got] == [(a.dtype, a.shape) for a in block]
        assert all(mx.array_equal(g, a).item() for g, a in zip(got, block, strict=True))
    link.close()
    link._thread.join(10)
    assert link.error is None and receiver.closed == []  # a goodbye is not a failure


def test_a_small_block_is_read_by_the_thread_that_waits_for_it():
    """A decode step's block wakes the thread that takes it and no other (the direct socket); a
    large block's chunks come through the listener's thread, which wakes the taker."""
    readers: dict[int, int] = {}

    def deliver(frame, data, array=None):
        readers[frame.step] = threading.get_ident()
        mailbox.put(frame, data, array)

    listener = SharedMemoryListener(TOKEN, deliver, lambda ring_id, source: None)
    mailbox = Mailbox(lambda frame, size: None, listener)
    link = SharedMemoryLink(listener.endpoint, "ring", 1, "peer", TOKEN)
    query_and_new_kv = [mx.arange(9 * 64, dtype=mx.float32), mx.ones((3, 64), mx.bfloat16), mx.zeros((3, 64))]
    large = [mx.ones((1 << 20,))]
    link.put(key(0), [to_host(a) for a in query_and_new_kv])  # one message
    link.put(key(1), [to_host(a) for a in large])
    abort = threading.Event()
    for step, block in enumerate([query_and_new_kv, large]):
        got = mailbox.take(key(step), 1, abort)
        assert all(mx.array_equal(to_mlx(g), a).item() for g, a in zip(got, block, strict=True))
    assert readers[0] == threading.get_ident() != readers[1]
    link.close()
    listener.close()


def test_every_tensor_lands_in_mlx_memory(receiver):
    """The receiving thread copies a one-chunk tensor straight into MLX memory, and gathers a larger
    one's chunks there, so the engine's thread takes both without another copy."""
    link = SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", TOKEN)
    whole = mx.random.normal((CHUNK_BYTES // 2 // 2, 2)).astype(mx.bfloat16)  # 4 MiB, one chunk
    larger = mx.random.normal((CHUNK_BYTES // 4 + 3,))  # two chunks
    link.put(key(0), [to_host(whole), to_host(larger)])
    got = receiver.take_host(key(0))
    assert all(g.array is not None and np.shares_memory(g.data, np.asarray(g.array)) for g in got)
    assert mx.array_equal(to_mlx(got[0]), whole).item() and mx.array_equal(to_mlx(got[1]), larger).item()
    link.close()


def test_a_small_buffer_wraps_and_waits_for_credits(receiver):
    """Twelve 4 MiB chunks through a buffer that holds two: the sender waits for the receiver and
    reuses the space, and nothing arrives damaged."""
    link = SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", TOKEN,
                            capacity=2 * CHUNK_BYTES + 3 * shm.ALIGN)
    blocks = [mx.full((CHUNK_BYTES // 4 - step,), float(step)) for step in range(12)]
    for step, block in enumerate(blocks):
        link.put(key(step), [to_host(block)])
    for step, block in enumerate(blocks):
        (got,) = receiver.take(key(step))
        assert mx.array_equal(got, block).item()
    link.close()


def test_small_blocks_to_a_receiver_that_stopped_reading_never_block_the_sender():
    """A receiver that stops reading (a rank under SIGSTOP) fills the socket: the sender's small
    blocks, which go out from its own thread, are handed to the link's thread instead of waiting;
    when the receiver reads again every block arrives, in full."""
    paused = threading.Event()

    def deliver(frame, data, array=None):
        paused.wait()
        mailbox.put(frame, data, array)

    listener = SharedMemoryListener(TOKEN, deliver, lambda ring_id, source: None)
    mailbox = Mailbox(lambda frame, size: None, listener)
    link = SharedMemoryLink(listener.endpoint, "ring", 1, "peer", TOKEN)
    blocks = [mx.full((3000,), float(step)) for step in range(200)]  # 12 KB each: inline, 2.4 MB in all
    host = [to_host(b) for b in blocks]
    assert sum(h.data.nbytes for h in host) > 4 * link._direct.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    sent = threading.Thread(target=lambda: [link.put(key(s), [h]) for s, h in enumerate(host)])
    sent.start()
    sent.join(timeout=30)
    assert not sent.is_alive() and link.error is None  # far more than the socket holds, and none waited
    paused.set()
    abort = threading.Event()
    for step, block in enumerate(blocks):
        (got,) = mailbox.take(key(step), 1, abort)
        assert mx.array_equal(to_mlx(got), block).item()
    link.close()
    listener.close()


def test_the_free_space_follows_the_oldest_chunk_in_flight():
    link = SharedMemoryLink.__new__(SharedMemoryLink)
    link._capacity, link._head = 100, 0
    link._inflight = shm.deque()
    assert link._free_at(60) == 0
    link._inflight.append((0, 60)), setattr(link, "_head", 60)
    assert link._free_at(40) == 60 and link._free_at(41) is None
    link._inflight.append((60, 100)), setattr(link, "_head", 100)
    link._inflight.popleft()  # [60, 100) in flight: the start is free again
    assert link._free_at(60) == 0 and link._free_at(61) is None
    link._inflight.append((0, 50)), setattr(link, "_head", 50)  # wrapped: free is [50, 60)
    assert link._free_at(10) == 50 and link._free_at(11) is None


def test_a_wrong_token_is_refused(receiver):
    with pytest.raises(ConnectionRefusedError):
        SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", "wrong")
    with pytest.raises(ConnectionRefusedError):
        SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", None)


def test_an_endpoint_on_no_host_here_cannot_be_reached():
    with pytest.raises(OSError):
        SharedMemoryLink("cpchat-nobody-0000", "ring", 1, "peer", TOKEN)


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])


SEND_AND_DIE = """
import os, mlx.core as mx
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport.shm import SharedMemoryLink
from cpchat.rank.transport.wire import BlockKey, to_host
link = SharedMemoryLink({endpoint!r}, "ring", 2, "peer", {token!r})
link.put(BlockKey("req", 0, 0, pb.KV), [to_host(mx.ones((1 << 20,)))])
link.close()  # queued behind the block, so the block is sent first; then a goodbye, unless we die
{end}
"""


def test_a_sender_that_dies_is_reported_and_one_that_closes_is_not(receiver):
    endpoint = receiver.listener.endpoint
    done = _child(SEND_AND_DIE.format(endpoint=endpoint, token=TOKEN, end="link._thread.join()"))
    assert done.returncode == 0, done.stderr
    assert mx.array_equal(receiver.take(key(0), source=2)[0], mx.ones((1 << 20,))).item()
    assert receiver.closed == []
    # A process killed (once its block has arrived) before it says goodbye.
    code = SEND_AND_DIE.format(endpoint=endpoint, token=TOKEN,
                               end="import sys; sys.stdin.readline(); os.kill(os.getpid(), 9)")
    child = subprocess.Popen([sys.executable, "-c", code.replace("link.close()", "pass")],
                             stdin=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    receiver.take(BlockKey("req", 0, 0, pb.KV), source=2)
    child.communicate("die\n", timeout=60)
    assert child.returncode == -9
    assert receiver.ended.wait(10)
    assert receiver.closed == [("ring", 2)]


def test_a_sender_of_small_blocks_that_dies_is_reported_to_the_rank_that_waits():
    """A link that only ever sent small blocks (its frames all on the direct socket, which only a
    waiting thread reads) is reported when its sender dies, to the thread that waits on it."""
    listener = SharedMemoryListener(TOKEN, lambda *chunk: mailbox.put(*chunk),
                                    lambda ring_id, source: mailbox.fail(f"link from rank {source} closed"))
    mailbox = Mailbox(lambda frame, size: None, listener)
    die = "import sys; sys.stdin.readline(); os.kill(os.getpid(), 9)"
    code = SEND_AND_DIE.replace("mx.ones((1 << 20,))", "mx.ones((8,))").format(
        endpoint=listener.endpoint, token=TOKEN, end=die)
    child = subprocess.Popen([sys.executable, "-c", code.replace("link.close()", "pass")],
                             stdin=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    abort = threading.Event()
    (got,) = mailbox.take(key(0), 2, abort)
    assert to_mlx(got).tolist() == [1.0] * 8
    child.communicate("die\n", timeout=60)
    assert child.returncode == -9
    with pytest.raises(RingBroken, match="link from rank 2 closed"):
        mailbox.take(key(1), 2, abort)
    listener.close()


def test_another_user_is_refused(receiver):
    if os.getuid() != 0:
        pytest.skip("needs root to become another user")  # CI runs as root
    hello = (shm.HELLO + TOKEN.encode()).decode()
    code = f"""
import os, socket
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\\0{receiver.listener.endpoint}")
fd = os.memfd_create("x"); os.ftruncate(fd, 1 << 20)
socket.send_fds(s, [{hello!r}.encode()], [fd])
print(repr(s.recv(8)))
"""
    done = _child(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "b''"  # the right token, the wrong user: closed without a word


def test_a_malformed_message_cuts_that_link_only_and_says_why(receiver, capfd):
    endpoint = receiver.listener.endpoint
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect("\0" + endpoint)
    fd = os.memfd_create("test")
    os.ftruncate(fd, 1 << 20)
    socket.send_fds(raw, [shm.HELLO + TOKEN.encode()], [fd])
    assert raw.recv(8) == shm.ACCEPTED
    header = pb.Frame(ring_id="ring", request_id="req", source_rank=1, tensor_count=1, chunk_count=1,
                      dtype="float32", shape=[1 << 20]).SerializeToString()
    raw.sendmsg([shm.CHUNK.pack(0, 4 << 20, len(header)), header])  # 4 MiB from a 1 MiB buffer
    assert raw.recv(8) == b""  # cut
    said = capfd.readouterr().err
    assert "cut a shared-memory link: bad frame: chunk lies outside the shared buffer" in said
    raw.close()
    os.close(fd)
    assert receiver.closed == []
    link = SharedMemoryLink(endpoint, "ring", 1, "peer", TOKEN)  # the listener still serves
    link.put(key(0), [to_host(mx.arange(3, dtype=mx.float32))])
    assert receiver.take(key(0))[0].tolist() == [0.0, 1.0, 2.0]


def test_a_malformed_direct_message_cuts_that_socket_and_says_why(receiver, capfd):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect("\0" + receiver.listener.endpoint)
    socket.send_fds(raw, [shm.HELLO_DIRECT + TOKEN.encode()], [])
    assert raw.recv(8) == shm.ACCEPTED
    header = pb.Frame(ring_id="ring", request_id="req", source_rank=1, tensor_count=1, chunk_count=1,
                      dtype="float32", shape=[4]).SerializeToString()
    raw.sendmsg([shm.CHUNK.pack(0, 16, len(header)), header])  # a direct socket has no buffer
    receiver.listener.wait(timeout=10)
    assert raw.recv(8) == b""  # cut
    said = capfd.readouterr().err
    assert "cut a shared-memory link: bad frame: a direct message's chunk does not fit it" in said
    raw.close()
    assert receiver.closed == []


def test_nothing_is_left_in_dev_shm(receiver):
    before = set(os.listdir("/dev/shm"))
    link = SharedMemoryLink(receiver.listener.endpoint, "ring", 1, "peer", TOKEN)
    link.put(key(0), [to_host(mx.array(np.ones(1 << 20, np.float32)))])
    receiver.take(key(0))
    assert set(os.listdir("/dev/shm")) == before  # memfds have no name
    link.close()
