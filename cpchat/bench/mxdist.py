"""Send/recv throughput of mx.distributed's ring backend, for comparison with
cpchat's gRPC ring. Run under `mlx.launch --backend ring -n 2`."""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from cpchat.bench.wirefloor import sustained_rate


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    group = mx.distributed.init(backend="ring")
    rank = group.rank()
    send_stream, recv_stream = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
    blocks: dict[int, mx.array] = {}

    def exchange(size: int) -> None:
        if size not in blocks:  # made in the untimed warm-up exchange
            blocks.clear()
            blocks[size] = mx.zeros((size // 4,), mx.float32)
        sent = mx.distributed.send(blocks[size], (rank + 1) % 2, group=group, stream=send_stream)
        got = mx.distributed.recv_like(blocks[size], (rank + 1) % 2, group=group, stream=recv_stream)
        mx.eval(sent, got)

    results = sustained_rate(exchange, sizes, rounds)
    if rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
