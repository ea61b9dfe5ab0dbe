"""mlx-lm's own single-process generation, timed the same way as cpchat.

Runs as a child process (`python -m cpchat.bench.baseline`) so it gets the
same BLAS environment as the ranks; prints one JSON line per repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--text", action="store_true", help="a prompt of prose (document_ids), not random ids")
    p.add_argument("--kv-bits", type=int, default=0)
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=5000)
    args = p.parse_args()

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from cpchat.blas import in_use

    model, tokenizer = mlx_lm.load(args.model)
    vocab = len(tokenizer.vocab)
    ids = document_ids(tokenizer, args.context) if args.text else prompt_ids(vocab, args.context)
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
          "quantized_kv_start": args.quantized_kv_start} if args.kv_bits else {}
    blas = in_use()
    if mx.default_device() != mx.cpu:  # a GPU compiles its kernels on first use (for each shape)
        mlx_lm.generate(model, tokenizer, ids, max_tokens=2)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        t_first = last = None
        cache = make_prompt_cache(model)
        for r in mlx_lm.stream_generate(
            model, tokenizer, ids, max_tokens=args.decode, sampler=make_sampler(0.0), prompt_cache=cache, **kv
        ):
            last = r
            t_first = t_first or time.perf_counter()
        print(
            json.dumps(
                {
                    "ttft_ms": 1000 * (t_first - t0),
                    "prefill_tokens_per_s": last.prompt_tps,
                    "decode_tokens_per_s": last.generation_tps,
                    "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    "kv_bytes": sum(c.nbytes for c in cache),
                    "blas": blas.label,
                    "threads": blas.threads,
                }
            ),
            flush=True,
        )


def prompt_ids(vocab: int, length: int, seed: int = 0) -> list[int]:
    """A reproducible prompt that avoids the special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def document_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of the sample document, repeated as needed: a real model given random ids may
    end its answer at once, which leaves no decode to time."""
    from cpchat.client.settings import bundled

    ids = tokenizer.encode(bundled("sample-doc.txt").read_text(encoding="utf-8"), add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


if __name__ == "__main__":
    main()
    # OpenBLAS's exit handler joins its threads, and 0.3.21's once waited forever here on one that
    # slept: the results are out, so leave without the handlers, as a rank does.
    os._exit(0)
