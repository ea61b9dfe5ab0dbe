"""What the wire itself allows: two local processes exchanging blocks, both directions at
once, over a gRPC Python stream of ready-made bytes (nothing done to them on either end)
and over a plain TCP socket. The ring's figures are read against these.

Run as `python wirefloor.py PEER_RANK GRPC_PORT0 GRPC_PORT1 SOCKET_PORT SIZES ROUNDS`;
`floor_rates` starts both peers.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

MESSAGE_BYTES = 4 << 20  # the ring's frame size (wire.CHUNK_BYTES)
Rates = dict[int, float]  # block bytes -> bytes/s per link


def floor_rates(sizes: list[int], rounds: int, env: dict[str, str] | None = None) -> dict[str, Rates]:
    """{"grpc": rates, "socket": rates}, or {} if a peer failed."""
    probes = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]  # three distinct free ports
    ports = [p.getsockname()[1] for p in probes]
    for p in probes:
        p.close()
    args = [*map(str, ports), ",".join(map(str, sizes)), str(rounds)]
    cmds = [[sys.executable, __file__, str(rank), *args] for rank in (0, 1)]
    peers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for cmd in cmds]
    try:
        out = peers[0].communicate(timeout=300)[0]
        peers[1].wait(timeout=30)
        result = json.loads(out.strip().splitlines()[-1])
        return {kind: {int(k): v for k, v in rates.items()} for kind, rates in result.items()}
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return {}
    finally:
        for p in peers:
            p.kill()
            p.wait()


def sustained_rate(exchange, sizes: list[int], rounds: int) -> Rates:
    """Bytes/s over `rounds` back-to-back exchanges after one untimed warm-up. Timing the run,
    not its best round: a peer that runs a round ahead makes single rounds look faster."""
    rates = {}
    for size in sizes:
        exchange(size)
        t0 = time.perf_counter()
        for _ in range(rounds):
            exchange(size)
        rates[size] = size * rounds / (time.perf_counter() - t0)
    return rates


def grpc_rates(rank: int, ports: list[int], sizes: list[int], rounds: int) -> Rates:
    received: queue.Queue[int] = queue.Queue()
    schedule = [size for size in sizes for _ in range(rounds + 1)]  # the peer sends the same blocks

    def link(messages, context):
        count, block = 0, 0
        for m in messages:
            count += len(m)
            if count == schedule[block]:
                received.put(count)
                count, block = 0, block + 1
        return b""

    options = [("grpc.max_receive_message_length", 2 * MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    handler = grpc.stream_unary_rpc_method_handler(link)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Pair", {"Link": handler}),))
    server.add_insecure_port(f"127.0.0.1:{ports[rank]}")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[1 - rank]}")
    grpc.channel_ready_future(channel).result(timeout=30)
    outbox: queue.Queue[int | None] = queue.Queue()
    payload = bytes(MESSAGE_BYTES)

    def messages():
        while (size := outbox.get()) is not None:
            for offset in range(0, size, MESSAGE_BYTES):
                yield payload if size - offset >= MESSAGE_BYTES else payload[: size - offset]

    stream = channel.stream_unary("/floor.Pair/Link")
    sender = threading.Thread(target=stream, args=(messages(),), daemon=True)
    sender.start()

    def exchange(size: int) -> None:
        outbox.put(size)
        received.get()

    rates = sustained_rate(exchange, sizes, rounds)
    outbox.put(None)
    sender.join(timeout=30)
    server.stop(1).wait()
    return rates


def socket_rates(rank: int, port: int, sizes: list[int], rounds: int) -> Rates:
    if rank == 0:
        with socket.create_server(("127.0.0.1", port)) as listener:
            conn, _ = listener.accept()
    else:
        conn = _connect(port)
    source, sink = bytearray(max(sizes)), bytearray(max(sizes))

    def exchange(size: int) -> None:
        sender = threading.Thread(target=conn.sendall, args=(memoryview(source)[:size],))
        sender.start()
        view, got = memoryview(sink), 0
        while got < size:
            n = conn.recv_into(view[got:size])
            if not n:
                raise ConnectionError("the other peer closed the socket")
            got += n
        sender.join()

    with conn:
        return sustained_rate(exchange, sizes, rounds)


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    rank, ports = int(sys.argv[1]), [int(p) for p in sys.argv[2:5]]
    sizes, rounds = [int(s) for s in sys.argv[5].split(",")], int(sys.argv[6])
    result = {"grpc": grpc_rates(rank, ports[:2], sizes, rounds)}
    result["socket"] = socket_rates(rank, ports[2], sizes, rounds)
    if rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
