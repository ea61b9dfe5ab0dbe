"""Start, load, generate and stop local ranks again and again with the cores shared out, and run
mlx-lm beside them on every core: the check that shared BLAS threads never hang a start, a load, a
generation or an exit (cpchat's speed issue). Each cycle has a deadline; a cycle past it is
reported with the phase it was in, and the run stops with exit status 1.

    python scripts/thread_cycles.py --cycles 300
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

from cpchat import blas
from cpchat.client.cluster import Cluster
from cpchat.client.generation import GenerationRequest
from cpchat.client.launcher import rank_environment
from cpchat.client.settings import demo_model

MLX_LM = ("import mlx.core as mx, mlx_lm; m, t = mlx_lm.load({path!r}); "
          "print(len(list(mlx_lm.stream_generate(m, t, list(range(3, 200)), max_tokens=8))))")


def cycle(index: int, model: str, phase: list[str]) -> int:
    """One start/load/generate/stop of 1 or 2 ranks (in turn), with mlx-lm beside them."""
    ranks = 1 + index % 2
    phase[0] = f"mlx-lm start ({blas.usable_cores()} threads)"
    beside = subprocess.Popen([sys.executable, "-c", MLX_LM.format(path=model)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=rank_environment(threads=blas.usable_cores()))
    phase[0] = f"start {ranks} rank(s)"
    cluster = Cluster.launch(ranks)
    try:
        cluster.connect()
        phase[0] = "load"
        cluster.load(model)
        phase[0] = "generate"
        tokens = sum(type(e).__name__ == "TokenOut"
                     for e in cluster.generate(GenerationRequest(tokens=list(range(3, 300)), max_tokens=8)))
    finally:
        phase[0] = "stop"
        cluster.close()
    phase[0] = "mlx-lm exit"
    beside.communicate()
    if beside.returncode:
        raise RuntimeError(f"mlx-lm beside the ranks exited with {beside.returncode}")
    return tokens


def run_cycle(index: int, model: str, phase: list[str], result: list[int]) -> None:
    result.append(cycle(index, model, phase))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds one cycle may take")
    args = p.parse_args()
    model = str(demo_model()[0])
    started = time.time()
    for i in range(args.cycles):
        phase, result = ["begin"], []
        worker = threading.Thread(target=run_cycle, args=(i, model, phase, result), daemon=True)
        t0 = time.time()
        worker.start()
        worker.join(args.deadline)
        if worker.is_alive():
            print(f"cycle {i + 1}: no progress in {args.deadline:.0f} s, in phase: {phase[0]}", flush=True)
            return 1
        if not result:
            print(f"cycle {i + 1}: failed in phase {phase[0]}", flush=True)
            return 1
        print(f"cycle {i + 1}/{args.cycles}: {1 + i % 2} rank(s), {result[0]} tokens, "
              f"{time.time() - t0:.1f} s", flush=True)
    print(f"{args.cycles} cycles in {time.time() - started:.0f} s, none hung", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
