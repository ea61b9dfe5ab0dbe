"""Where one rank's prefill and decode steps spend their time, beside mlx-lm's on the same model and
prompt, on whatever device MLX runs (CPU or GPU): the rank's engine in this process (a ring of one),
a prefill of --context tokens, then --decode tokens, each under cProfile, after a warm-up run of both (a GPU
compiles its kernels on first use).

    python scripts/profile_decode.py [MODEL] --context 4096 --decode 32 [--form bfloat16]

Without MODEL, the bench's random llama of --hidden and --layers.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time

import mlx.core as mx
import mlx_lm

from cpchat import blas
from cpchat.bench.baseline import prompt_ids
from cpchat.bench.models import in_form, random_model
from cpchat.client.launcher import rank_environment
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.engine import Engine
from cpchat.rank.transport.ring import Mailbox, Ring


def cpchat_times(engine: Engine, ids: list[int], decode: int, profiles: list[cProfile.Profile]
                 ) -> tuple[float, float]:
    """Seconds to the first token, and ms a decode token."""
    ring, abort = Ring(0, 1, {}, Mailbox(lambda frame, size: None)), threading.Event()
    tokens: list[int] = []
    stamps: list[float] = []

    def emit(event: pb.GenerateEvent) -> None:
        if event.HasField("token"):
            tokens.append(event.token.id)
            stamps.append(time.perf_counter())

    warm = pb.GenerateRequest(request_id="warm-up", tokens=ids, max_tokens=2)
    engine.generate(warm, ring, abort, lambda event: None)
    t0 = time.perf_counter()
    profiles[0].enable()
    engine.generate(pb.GenerateRequest(request_id="prefill", tokens=ids, max_tokens=1), ring, abort, emit)
    profiles[0].disable()
    ttft = time.perf_counter() - t0
    request = pb.GenerateRequest(request_id="decode", keep_tokens=len(ids), tokens=tokens[-1:],
                                 max_tokens=decode)
    stamps.clear()
    profiles[1].enable()
    engine.generate(request, ring, abort, emit)
    profiles[1].disable()
    return ttft, 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def mlx_lm_times(path: str, ids: list[int], decode: int) -> tuple[float, float]:
    model, tokenizer = mlx_lm.load(path)
    mlx_lm.generate(model, tokenizer, ids, max_tokens=2)  # a GPU compiles its kernels first
    last = list(mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=decode))[-1]
    return len(ids) / last.prompt_tps, 1000 / last.generation_tps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--form", default="float32")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    # As a rank runs: the fast BLAS preloaded, on every core (a re-execution, once).
    blas.rerun_preloaded([__file__, *sys.argv[1:]], rank_environment(threads=blas.usable_cores()))
    path = args.model or str(in_form(random_model(args.hidden, args.layers), args.form))

    engine = Engine()
    info = engine.load(path)
    ids = prompt_ids(info.vocab_size, args.context)
    profiles = [cProfile.Profile(), cProfile.Profile()]
    ttft, ms = cpchat_times(engine, ids, args.decode, profiles)
    their_ttft, their_ms = mlx_lm_times(path, ids, args.decode)
    print(f"device {mx.default_device()}, {path}, {args.context} tokens:\n"
          f"  prefill: cpchat {ttft:.3f} s, mlx-lm {their_ttft:.3f} s ({their_ttft / ttft:.2f}x)\n"
          f"  decode: cpchat {ms:.2f} ms a token, mlx-lm {their_ms:.2f} ({their_ms / ms:.2f}x)")
    for name, profile in zip(("prefill", "decode"), profiles, strict=True):
        print(f"==== {name}")
        stats = pstats.Stats(profile).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
