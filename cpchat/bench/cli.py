"""`cpchat bench`'s command line: its flags, and which comparison they run. Generation over growing
contexts for N ranks next to mlx-lm and the ring transport next to mx.distributed (compare_mlx_lm.py),
the prefill algorithms side by side (--algorithms: compare_algorithms.py), a second session's TTFT with
the first one's prefix loaded from disk (--prefix-cache: prefix_cache.py), a prefill with one rank
slowed under each --shares mode (shares.py), decode with speculative decoding and without (--speculate:
speculation.py), or partial_attention next to
the fused kernel (--attention: attention.py); each writes a Markdown table, the JSON and a chart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cpchat import blas
from cpchat.bench import compare_algorithms, compare_mlx_lm, prefix_cache, shares, speculation
from cpchat.bench.models import ARCHS
from cpchat.bench.report import command_line
from cpchat.client.cluster import TRANSPORTS
from cpchat.client.launcher import rank_environment
from cpchat.client.settings import REPO_ASSETS
from cpchat.core.algorithms import ALGORITHMS
from cpchat.core.quantized_kv import GROUP_SIZES, QUANTIZED_KV_START
from cpchat.flags import add_threads_flag

DESCRIPTION = """The benchmark driver: generation over growing contexts for N ranks next to
mlx-lm, the ring transport next to mx.distributed, a Markdown table and a chart.

Every figure is a ratio or a rate measured in the same run, on the same model
and prompt, so a noisy machine shifts both sides alike.
"""  # --help's text

# Defaults that depend on the mode: the prefix cache pays off on long documents, and each of its
# repeats is three sessions on fresh ranks.
DEFAULTS = {"contexts": "1024,2048,4096,8192,16384", "ranks": "1,2,4", "repeats": 3, "decode": 16}
PREFIX_CACHE_DEFAULTS = {"contexts": "8192,32768", "ranks": "2,4", "repeats": 1, "decode": 16}
SPECULATE_DEFAULTS = {"contexts": "4096,16384", "ranks": "1,2", "repeats": 3, "decode": 128}

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpchat bench", description=DESCRIPTION)
    p.add_argument("--quick", action="store_true", help="a small preset that finishes in about two minutes")
    p.add_argument("--model", help="mlx-lm model directory, GGUF file, ollama:NAME or smollm2 (default: a "
                                    "random llama of --hidden/--layers; with --prefix-cache the demo model); "
                                    "a real model is prompted with prose")
    p.add_argument("--arch", default="llama", choices=ARCHS,
                   help="the random model's family: llama, or a hybrid with linear-attention layers "
                        "(qwen3_5: Gated DeltaNet, nemotron_h: Mamba-2; one full-attention layer in four)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, help="query heads (default hidden/64)")
    p.add_argument("--kv-heads", metavar="LIST",
                   help="KV heads of the random model (default: a quarter of the query heads); with "
                        "--algorithms a comma list, one model each (e.g. 4,16 for GQA and MHA)")
    p.add_argument("--form", default="float32",
                   help="convert the model with mlx_lm.convert: bfloat16, float16, q4g64 (bits, group size)")
    p.add_argument("--contexts", help=f"comma-separated prompt lengths (default {DEFAULTS['contexts']}; "
                                      f"with --prefix-cache {PREFIX_CACHE_DEFAULTS['contexts']})")
    p.add_argument("--ranks", help=f"comma-separated rank counts (default {DEFAULTS['ranks']}; with "
                                   f"--prefix-cache {PREFIX_CACHE_DEFAULTS['ranks']})")
    p.add_argument("--stages", default="1", metavar="LIST",
                   help="pipeline stages of the cpchat rows: a comma list (default 1); a row for each that "
                        "divides the rank count (e.g. --ranks 2,4 --stages 1,2)")
    p.add_argument("--kv-bits", default="0", metavar="LIST",
                   help="K/V formats to measure, cpchat's and mlx-lm's alike: a comma list of 0 (the model's "
                        "dtype), 8 and 4 (default 0)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=GROUP_SIZES)
    p.add_argument("--quantized-kv-start", type=int, default=QUANTIZED_KV_START, metavar="S")
    p.add_argument("--decode", type=int, help="tokens to generate per run (default 16; with --speculate 128)")
    p.add_argument("--repeats", type=int,
                   help=f"runs of each measurement: TTFT keeps the best, the transport rows the median "
                        f"(default {DEFAULTS['repeats']}; with --prefix-cache "
                        f"{PREFIX_CACHE_DEFAULTS['repeats']})")
    p.add_argument("--algorithm", default="pass_kv", choices=list(ALGORITHMS))
    p.add_argument("--algorithms", metavar="LIST",
                   help="compare prefill algorithms instead of mlx-lm: a comma list of "
                        "pass_kv,pass_q,all_gather,ulysses,auto, or all")
    p.add_argument("--decode-exchange", default="exchange", metavar="LIST",
                   help="with --algorithms: decode steps to time, a comma list of exchange,ring,lead,gather")
    p.add_argument("--pin", action="store_true", help="pin rank i to core i (and mlx-lm to core 0)")
    add_threads_flag(p)
    p.add_argument("--blas", default="auto",
                   help="comma-separated BLAS runs, each of auto (the fastest installed; default), openblas, "
                        "mkl, reference; both = auto,reference")
    p.add_argument(
        "--transport", default="1,4,16,64", help="block sizes in MiB for the ring benchmark ('' skips)"
    )
    p.add_argument("--data-planes", default="auto", metavar="LIST",
                   help=f"the cpchat rows' transports, a comma list of {', '.join(TRANSPORTS)} "
                        f"(one row each)")
    p.add_argument(
        "--no-baseline", action="store_true", help="skip mlx-lm (e.g. for contexts it cannot hold)"
    )
    p.add_argument(
        "--no-overlap", action="store_true", help="skip the extra pass-KV prefill that measures overlap"
    )
    p.add_argument("--shares", metavar="LIST",
                   help="time the prefill under these --shares modes instead of mlx-lm, e.g. equal,auto,2/1, "
                        "with one rank slowed by --slow")
    p.add_argument("--slow", metavar="RANK:FRACTION", default="1:0.5",
                   help="with --shares: hold that local rank to FRACTION of a core by a CPU quota (Linux, "
                        "as root; default 1:0.5)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="time a second session on new ranks that loads the first one's saved prefix from "
                        "disk, against the first; the save's cost on the first turn; disk bytes per rank "
                        "(prefix-cache.md)")
    p.add_argument("--speculate", metavar="LIST",
                   help="time decode with speculative decoding against without, e.g. off,lookup: a question "
                        "whose answer quotes the document and one that copies nothing (speculation.md)")
    p.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                   help="with --speculate: tokens proposed a step (default: adaptive)")
    p.add_argument("--link-delay-ms", type=float, default=0.0, metavar="MS",
                   help="with --speculate: every message between the ranks waits this long (a slow network)")
    out = REPO_ASSETS / "bench" if REPO_ASSETS.is_dir() else Path("cpchat-bench")  # a checkout, or here
    p.add_argument("--out", default=str(out),
                   help="where results.md/.json/.png go (prefix-cache.* with --prefix-cache)")
    p.add_argument(
        "--attention",
        metavar="LENGTHS",
        help="only time partial_attention against the fused kernel at these lengths (e.g. 4096,16384)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    defaults = DEFAULTS
    if args.speculate or args.prefix_cache:
        defaults = SPECULATE_DEFAULTS if args.speculate else PREFIX_CACHE_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.hidden, args.layers, args.contexts, args.ranks = 256, 4, "512,1024", "1,2"
        args.repeats, args.decode, args.transport = 1, 8, "1,16"
    try:  # before anything runs: a typo found after an hour's runs would lose them
        for flag in ("contexts", "ranks", "stages", "transport", "attention"):
            setattr(args, flag, counts(f"--{flag}", getattr(args, flag) or ""))
        blas_modes = blas_choices(args.blas)
    except (ValueError, blas.BlasUnavailable) as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    if args.attention:
        return attention_only(args.attention)
    if args.algorithms or args.prefix_cache or args.shares or args.speculate:
        if len(blas_modes) > 1:
            print("cpchat bench: --algorithms, --shares, --prefix-cache and --speculate run one BLAS; "
                  "compare BLAS without them", file=sys.stderr)
            return 2
        args.blas_choice = blas_modes[0]
        if args.speculate:
            return speculation.run_speculation(args, command_line(argv))
        if args.shares:
            return shares.run_shares(args, command_line(argv))
        if args.prefix_cache:
            return prefix_cache.run_prefix_cache(args, command_line(argv))
        return compare_algorithms.run_comparison(args, command_line(argv))
    return compare_mlx_lm.run_comparison(args, blas_modes, command_line(argv))


def counts(flag: str, text: str) -> list[int]:
    """A comma list of whole numbers, at least 1 each ('' is none)."""
    try:
        numbers = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        numbers = [0]
    if any(n < 1 for n in numbers):
        raise ValueError(f"{flag} {text}: expected a comma list of whole numbers")
    return numbers


def blas_choices(text: str) -> list[str]:
    """The --blas runs to make; a library that cannot be loaded is an error, never a fallback."""
    if text == "both":
        if blas.choose("auto")[0] == "reference":
            raise blas.BlasUnavailable(f"--blas both: no fast BLAS found to compare; install one with: "
                                       f"{blas.install_hint()}")
        return ["auto", "reference"]
    choices = [c.strip() for c in text.split(",") if c.strip()]
    for choice in choices:
        if choice not in blas.CHOICES:
            raise blas.BlasUnavailable(f"--blas {choice}: expected one of {', '.join(blas.CHOICES)}")
        blas.choose(choice)
    return choices


def attention_only(lengths: list[int]) -> int:
    """Run the attention micro-benchmark in a child with the ranks' BLAS environment."""
    code = (
        "import json,sys; from cpchat.bench.attention import time_attention; "
        "[print(json.dumps(time_attention(int(n))), flush=True) for n in sys.argv[1:]]"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, lengths)],
        env=rank_environment(threads=blas.usable_cores()),
        capture_output=True,
        text=True,
        check=True,
    )
    print(
        "| causal length | fused s | partial_attention s | ratio | max abs error |\n"
        "|---:|---:|---:|---:|---:|"
    )
    for line in done.stdout.splitlines():
        r = json.loads(line)
        print(
            f"| {r['length']} | {r['fused_s']:.2f} | {r['tiled_s']:.2f} | {r['ratio']:.2f} "
            f"| {r['max_abs_error']:.1e} |"
        )
    return 0
