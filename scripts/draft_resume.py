"""A draft model's read of a conversation against taking its state back from the prefix cache.

    python scripts/draft_resume.py [--model smollm2] [--tokens 4096]

Runs where a rank would (OpenBLAS preloaded, as `cpchat rank` re-executes itself): the draft reads
`--tokens` random tokens and proposes three, its state is saved as the sampling rank saves it beside
the ring's prefix, and a new draft (a rank started again) takes it back and proposes after three
more tokens. Prints the three times and the file's size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cpchat import blas


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    environment = blas.thread_environment(2, blas.preload_environment("auto"))
    blas.rerun_preloaded([__file__, *sys.argv[1:]], environment)  # as a rank runs

    from cpchat.rank.draft import DraftModel
    from cpchat.rank.prefix_cache import PrefixStore
    from cpchat.rank.prefix_keeper import PrefixKeeper

    keeper = PrefixKeeper()
    keeper.cache = PrefixStore(Path(tempfile.mkdtemp()), 1 << 40)
    tokens = np.random.default_rng(0).integers(3, 1000, args.tokens).astype(np.uint32)
    draft = DraftModel(args.model, copy_budget=1 << 30)
    t = time.perf_counter()
    draft.propose(tokens, 3)
    read = time.perf_counter() - t
    keeper.tokens = tokens
    t = time.perf_counter()
    draft.save(keeper)
    keeper.flush()
    saved = time.perf_counter() - t
    again = DraftModel(args.model, copy_budget=1 << 30)
    question = np.append(tokens, [11, 12, 13]).astype(np.uint32)
    t = time.perf_counter()
    again.resume(keeper, question)
    again.propose(question, 3)
    resumed = time.perf_counter() - t
    size = sum(e.size for e in keeper.cache.entries())
    print(f"{args.model}, {args.tokens:,} tokens: read by the draft {read:.2f} s; saved {saved:.2f} s "
          f"({size / 2**20:.0f} MiB); taken back and three proposed {resumed:.2f} s")


if __name__ == "__main__":
    main()
