"""Send/recv throughput of mx.distributed's ring backend, for comparison with
cpchat's gRPC ring. Run under `mlx.launch --backend ring -n 2`."""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    group = mx.distributed.init(backend="ring")
    rank = group.rank()
    send_stream, recv_stream = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
    results = {}
    for size in sizes:
        block = mx.zeros((size // 4,), mx.float32)
        mx.eval(block)
        for round_ in range(rounds + 1):  # the first one warms the link up, untimed
            if round_ == 1:
                t0 = time.perf_counter()
            sent = mx.distributed.send(block, (rank + 1) % 2, group=group, stream=send_stream)
            got = mx.distributed.recv_like(block, (rank + 1) % 2, group=group, stream=recv_stream)
            mx.eval(sent, got)
        results[size] = size * rounds / (time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
