"""What one decode step over B conversations at once costs against B steps of one: the weights are read
once for the batch, which is where a memory-bound decode gains (`cpchat serve`'s batching).

    python scripts/batched_decode.py [--model M] [--context 4096] [--batches 1,2,4,8] [--steps 16]
    python scripts/batched_decode.py --ranks N [--model M] [--context 4096] [--batches 1,2,4,8]

Without --ranks: mlx-lm's own model and K/V caches in this process, as a rank holds them (the fast BLAS
preloaded, float32 copies of low-precision weights), each conversation `--context` tokens long (random
K/V: a step's cost does not depend on their values): the bound a batched step can reach. Prints, per
batch size B: one step's time for the batch, the same B conversations stepped one at a time, and the
aggregate tokens/s of each.

With --ranks N: through N local ranks, as `cpchat serve` runs them: one answer decoded by the ranks'
own loop (speculative decoding off), then B answers of `--context`-token prompts stepped together
(the Step call). Prints the decode tokens/s of each.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from cpchat import blas
from cpchat.client.hub import front_end_copy
from cpchat.client.settings import resolve_model
from cpchat.rank.cpu_products import keep_float32_weights, use_float32_products


def filled_cache(model, batch: int, context: int) -> list:
    """mlx-lm's caches for `batch` conversations of `context` tokens each."""
    cache = make_prompt_cache(model)
    for layer in cache:
        keys = mx.random.normal((batch, layer_heads(model), context, head_dim(model)))
        layer.update_and_fetch(keys, keys)
    mx.eval([c.state for c in cache])
    return cache


def layer_heads(model) -> int:
    args = model.args
    return getattr(args, "num_key_value_heads", None) or args.num_attention_heads


def head_dim(model) -> int:
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def step_time(model, cache: list, batch: int, steps: int) -> float:
    """Seconds a decode step of `batch` tokens takes, the mean of `steps` after one to warm up."""
    tokens = mx.ones((batch, 1), dtype=mx.int32)
    mx.eval(model(tokens, cache=cache))
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(tokens, cache=cache))
    return (time.perf_counter() - start) / steps


def through_ranks(args: argparse.Namespace) -> None:
    """Decode tokens/s through real ranks: one answer by the ranks' own loop, and B stepped together."""
    from cpchat.client.batch import Batch, until_batched
    from cpchat.client.cluster import Cluster
    from cpchat.client.held import HeldConversations
    from cpchat.client.session import SamplingOptions, Session, load_tokenizer

    path = resolve_model(args.model)[0]
    cluster = Cluster.launch(args.ranks)
    try:
        cluster.connect()
        cluster.load(str(path))
        sampling = SamplingOptions(max_tokens=args.steps * 4, temperature=0.0, ignore_eos=True)
        session = Session(cluster, load_tokenizer(front_end_copy(path, whole_model=False)), raw=True,
                          sampling=sampling, speculate="off")
        session.conversations = HeldConversations(limit=64)
        vocab = cluster.model.vocab_size
        prompts = (mx.random.randint(0, vocab, (args.context,), key=mx.random.key(i)).tolist()
                   for i in range(1_000_000))
        done = list(session.generate(next(prompts)))[-1]
        print(f"`python scripts/batched_decode.py --ranks {args.ranks} --model {args.model or 'demo'} "
              f"--context {args.context}`\n")
        print(f"the ranks' own loop, one answer: {done.decode_tokens_per_s:.1f} tokens/s\n")
        print("| B | step, ms | aggregate tokens/s |")
        print("|---:|---:|---:|")
        for size in map(int, args.batches.split(",")):
            batch = Batch(session)
            for _ in range(size):
                events = session.generate(next(prompts), args.steps * 4, batched=True)
                batch.add(until_batched(events, lambda event: None))
            batch.step()  # the first step's one-off costs, outside the figures
            start = time.perf_counter()
            for _ in range(args.steps):
                batch.step()
            step = (time.perf_counter() - start) / args.steps
            print(f"| {size} | {1000 * step:.1f} | {size / step:.1f} |", flush=True)
            for answer in list(batch.answers):
                batch.cancel(answer)
            session.reset()
    finally:
        cluster.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ranks", type=int, default=0, help="through so many local ranks (0: in this process)")
    args = p.parse_args()
    if args.ranks:
        through_ranks(args)
        return 0
    env = blas.thread_environment(blas.usable_cores(), blas.preload_environment("auto"))
    blas.rerun_preloaded([__file__, *sys.argv[1:]], env)
    model, _ = load(front_end_copy(resolve_model(args.model)[0], whole_model=True))
    use_float32_products(model)
    keep_float32_weights(model, 1 << 34)
    print(f"`python scripts/batched_decode.py --model {args.model or 'demo'} --context {args.context}`\n")
    print("| B | batch step, ms | B single steps, ms | aggregate tokens/s, batched | one at a time | gain |")
    print("|---:|---:|---:|---:|---:|---:|")
    single = step_time(model, filled_cache(model, 1, args.context), 1, args.steps)
    for batch in map(int, args.batches.split(",")):
        together = step_time(model, filled_cache(model, batch, args.context), batch, args.steps)
        print(f"| {batch} | {1000 * together:.1f} | {1000 * batch * single:.1f} | {batch / together:.1f} | "
              f"{1 / single:.1f} | {batch * single / together:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
