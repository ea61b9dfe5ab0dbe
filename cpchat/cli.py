"""Argument parsing for every entry point: the app, `cpchat rank`, `cpchat bench`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from cpchat import EXIT_BACKEND, EXIT_OK, EXIT_USAGE, __version__, blas
from cpchat.client.cluster import TRANSPORTS
from cpchat.client.connect import ClusterOptions, is_loopback, read_bytes, read_token
from cpchat.core.algorithms import ALGORITHMS
from cpchat.core.quantized_kv import BITS, GROUP_SIZES
from cpchat.errors import BadInput
from cpchat.flags import add_threads_flag, byte_size, positive_int, whole_number

if TYPE_CHECKING:
    from cpchat.client.settings import Settings


def app_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpchat",
        description="Chat over very long contexts with context-parallel attention across rank processes.",
        epilog="Subcommands: 'cpchat rank --help' (serve a rank), 'cpchat bench --help' (benchmarks), "
               "'cpchat plan --help' (what a context needs).",
    )
    p.add_argument("--version", action="version", version=f"cpchat {__version__}")
    add_cluster_flags(p)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temp", type=float, default=None, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    add_speculation_flags(p)
    p.add_argument("--headless", action="store_true", help="no TUI: a scripted run")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the user message (headless)")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the user message from a file (headless)")
    p.add_argument("--doc", action="append", default=[], metavar="FILE", help="document for the first turn")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--json", action="store_true", help="headless output as JSON lines")
    p.add_argument("--progress", action="store_true",
                   help="headless plain output: report prefill progress on stderr")
    p.add_argument("--resume", nargs="?", const="last", default=None, metavar="ID",
                   help="reopen a saved conversation (TUI): the last one, or ID from --list (a unique "
                        "prefix will do)")
    p.add_argument("--list", action="store_true", help="list the saved conversations, newest first, and exit")
    p.add_argument("--print-config", action="store_true", help="show the settings and where each came from")
    p.add_argument("--list-architectures", action="store_true", help="which model families work, and why not")
    p.add_argument("--list-models", action="store_true",
                   help="the models on this machine and whether cpchat runs each (with --json: JSON lines)")
    add_cache_flags(p)
    return p


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The model and the ranks it runs on, as the app and `cpchat plan` take them."""
    p.add_argument("--model", help="mlx-lm model directory, hub id ORG/NAME[@rev], GGUF file, "
                                    "ollama:NAME[:TAG], or smollm2 (fetched once; default: the demo model)")
    p.add_argument("--ranks", type=int, default=None, help="launch N local rank processes (default 2)")
    ring = p.add_mutually_exclusive_group()
    ring.add_argument("--attach", metavar="ADDR,...", help="use running ranks, in ring order (host:port,...)")
    ring.add_argument("--hostfile", metavar="FILE",
                      help="one host:port per line, '#' comments; with --launch also mlx.launch's JSON")
    p.add_argument("--launch", action="store_true",
                   help="start the hostfile's ranks over ssh (your ssh config, keys) and stop them on exit")
    p.add_argument("--token-file", metavar="FILE", help="shared secret for ranks reached over a network")
    p.add_argument("--tls-ca", metavar="FILE", help="CA certificate to verify ranks' TLS certificates")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                   help="how attention crosses the ranks; auto (default) picks the least estimated time")
    p.add_argument("--shares", metavar="auto|equal|W1,W2,...", default=None,
                   help="each rank's share of a prompt: auto (default) in proportion to the speed each "
                        "rank measured, equal, or weights in ring order (e.g. 2,1)")
    p.add_argument("--stages", metavar="P|auto|L1,L2,...", default=None,
                   help="split the model's layers over P pipeline stages of the ranks (each rank reads only "
                        "its stage's weights): 1 (default), auto (the fewest whose ranks hold the weights), "
                        "or layers per stage (e.g. 12,18)")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how tensors travel between ranks: auto (default) uses shared memory between ranks "
                        "on one host and gRPC between hosts; grpc: gRPC only; shm: shared memory only; "
                        "mlx: an mx.distributed group (its TCP ring backend) between ring neighbours")
    p.add_argument("--devices", default="all", metavar="all|none|I,J,...",
                   help="GPUs the local ranks run on, one rank per GPU in turn (CUDA): all visible "
                        "(default), none, or a comma list of device indices")
    add_kv_flags(p)
    p.add_argument("--blas", choices=blas.CHOICES,
                   help="BLAS of the local ranks (Linux): auto takes the fastest installed (default)")
    add_threads_flag(p)


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpchat plan",
        description="What a model and a context need on each rank (weights, K/V, peak memory) and how fast "
                    "they run, measured by the ranks themselves before anything is sent. Exit 0 when every "
                    "rank can hold it, 1 when one cannot.")
    p.add_argument("--context", type=token_count, required=True, metavar="T",
                   help="prompt tokens: 32768, 32K, 1M (K = 1024)")
    add_cluster_flags(p)
    p.add_argument("--max-tokens", type=int, default=None, help="the answer's tokens (default 256)")
    add_speculation_flags(p)
    p.add_argument("--paper", metavar="HOSTS", default=None,
                   help="plan on paper for hosts that are not here, given by their memory: 8x64G or "
                        "64G,64G,32G (no ranks start; the model's weights need not be here, its "
                        "config.json must)")
    return p


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpchat serve",
        description="The ranks behind an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health and /metrics. Prompts are read one at a time, in order; the "
                    "answers under way decode together; the ranks keep several conversations, the least "
                    "recently used let go first.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="bearer token every request must carry (also CPCHAT_API_KEY); required beyond "
                        "loopback")
    p.add_argument("--insecure", action="store_true", help="listen beyond loopback without an API key")
    p.add_argument("--max-queue", type=positive_int, default=16, metavar="N",
                   help="requests that may wait for the ranks; past them, 429 (default 16)")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="answers decoding together, a step for all at once (default 8; fewer where the "
                        "memory check leaves no room for another). 1: each answer whole, in turn, with "
                        "speculative decoding; pipeline stages run 1")
    p.add_argument("--prefill-chunk", type=whole_number, default=2048, metavar="T",
                   help="read long prompts T tokens at a time (a multiple of 2,048), the answers under way "
                        "stepping on between chunks (default 2048; 0: each prompt whole)")
    p.add_argument("--max-request-bytes", type=positive_int, default=64 << 20, metavar="B",
                   help="largest request body; past it, 413 (default 64 MiB)")
    p.add_argument("--kv-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="K/V and states of conversations the ranks keep between requests, on any one rank "
                        "(e.g. 4G); the least recently used go first, to the prefix cache on disk (default: "
                        "as many as memory allows, 64 at most: one goes when a request needs its room)")
    add_cluster_flags(p)
    p.add_argument("--max-tokens", type=int, default=None, help="answer tokens when a request does not say")
    p.add_argument("--temp", type=float, default=None, help="temperature when a request does not say (0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    add_speculation_flags(p)
    add_cache_flags(p)
    return p


def run_serve(argv: list[str]) -> int:
    from cpchat.serve.server import run_serve as serve

    args = app_parser().parse_args([])
    vars(args).update(vars(serve_parser().parse_args(argv)))
    return serve(args, cluster_options(args))


def token_count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    try:
        value = float(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count (32768, 32K, 1M), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least one token, got {text!r}")
    return int(value)


def run_plan(argv: list[str]) -> int:
    """`cpchat plan`: launch or attach the ranks, load the model, and print what the context needs."""
    from cpchat.client.frontend import Frontend
    from cpchat.client.plan import make_plan, plan_lines
    from cpchat.client.planner import Planner
    from cpchat.client.settings import resolve_settings
    from cpchat.errors import BackendError

    args = app_parser().parse_args([])
    vars(args).update(vars(plan_parser().parse_args(argv)))
    front = None
    try:
        settings = resolve_settings(args)
        if args.paper:
            return plan_on_paper(args.paper, settings, args.context)
        front = Frontend(settings, cluster_options(args), say=lambda line: print(line, file=sys.stderr))
        front.start(lambda phase, done, total: None)
        planner = Planner(front.cluster, settings.algorithm, shares=settings.shares)
        mode, _, draft = front.speculate.partition(":")
        plan = make_plan(planner, args.context, settings.max_tokens, draft if mode == "draft" else "")
        for line in plan_lines(plan, settings.model or "the demo model"):
            print(line)
        return 1 if plan.refusal else EXIT_OK
    except BadInput as e:
        print(f"cpchat plan: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BackendError as e:
        print(f"cpchat plan: {e}", file=sys.stderr)
        return EXIT_BACKEND
    finally:
        if front is not None:
            front.close(generating=False)


def plan_on_paper(hosts: str, settings: Settings, context: int) -> int:
    """`cpchat plan --paper HOSTS`: the plan from the model's shapes, on hosts given by their memory."""
    from pathlib import Path

    from cpchat.client.hub import front_end_copy
    from cpchat.client.paper import paper_lines, paper_model, parse_hosts
    from cpchat.client.settings import resolve_model
    from cpchat.core.paper_plan import paper_plan

    memory = parse_hosts(hosts)
    model = paper_model(Path(front_end_copy(resolve_model(settings.model)[0], whole_model=False)),
                        settings.kv_format)
    plan = paper_plan(model, memory, context, settings.stage_split)
    if plan is None:
        raise BadInput(f"--stages does not split the model's {len(model.kv)} layers over {len(memory)} hosts")
    for line in paper_lines(plan, settings.model or "the demo model"):
        print(line)
    return EXIT_OK if plan.holds else 1


def rank_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpchat rank", description="Serve one rank of a cpchat ring.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7070, help="port to bind; 0 picks a free one and reports it")
    p.add_argument("--token-file", metavar="FILE", help="shared secret; required to bind a non-loopback host")
    p.add_argument("--tls-cert", metavar="FILE")
    p.add_argument("--tls-key", metavar="FILE")
    p.add_argument("--tls-ca", metavar="FILE", help="CA to verify the next rank's certificate")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, help="pin this rank to one CPU core")
    p.add_argument("--blas", choices=blas.CHOICES, default="auto",
                   help="the BLAS for CPU products (Linux): auto takes the fastest installed (default)")
    add_threads_flag(p)
    p.add_argument("--ranks-here", type=int, default=1, metavar="K",
                   help="ranks started on this machine together: without --threads, each takes an "
                        "equal share of the cores; their measured speeds are scaled by the cores' sharing "
                        "(default 1: all of them)")
    p.add_argument("--memory-limit", metavar="SIZE", default=os.environ.get("CPCHAT_MEMORY_LIMIT"),
                   help="the most this rank may hold, e.g. 12G: prompts that would need more are refused "
                        "before they start (default $CPCHAT_MEMORY_LIMIT, else what the machine has)")
    add_cache_flags(p)
    return p


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """mlx-lm's K/V quantization flags, with its meaning and defaults."""
    p.add_argument("--kv-bits", type=int, choices=BITS, default=None,
                   help="keep K/V quantized to this many bits, on every rank and on the ring (mlx-lm's "
                        "--kv-bits; default: the model's dtype)")
    p.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="values per quantization group along the head dimension (default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=None, metavar="S",
                   help="quantize once the K/V hold this many tokens, as mlx-lm does (default 5000)")


def add_speculation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", metavar="off|lookup|auto|draft:MODEL", default=None,
                   help="speculative decoding: each step also checks tokens proposed from the conversation "
                        "itself (lookup) or by a small model of the same tokenizer (draft:MODEL) and keeps "
                        "those the model would have produced; the answer is the same. auto (default): lookup")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed a step (default: adaptive, more while they are accepted; "
                        "3 from a draft model)")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="where ranks keep saved prefixes (default: <user cache dir>/cpchat/prefix)")
    p.add_argument("--cache-max-gb", type=float, default=None, metavar="G",
                   help="bound on each rank's saved prefixes, least recently used go first (default 16)")
    p.add_argument("--no-cache", action="store_true", default=None,
                   help="neither save nor reuse prefixes on disk")


class UsageError(Exception):
    pass


def prefix_store(directory: str | None, max_gb: float | None):
    """The rank's prefix cache: flags, else $CPCHAT_CACHE_DIR / $CPCHAT_CACHE_MAX_GB, else the defaults."""
    from pathlib import Path

    from cpchat.dirs import PREFIX_CACHE_GB, prefix_dir
    from cpchat.rank.prefix_cache import PrefixStore

    if max_gb is None:
        try:
            max_gb = float(os.environ.get("CPCHAT_CACHE_MAX_GB") or PREFIX_CACHE_GB)
        except ValueError:
            value = os.environ["CPCHAT_CACHE_MAX_GB"]
            raise UsageError(f"CPCHAT_CACHE_MAX_GB={value!r} is not a number") from None
    if max_gb < 0:
        raise UsageError("--cache-max-gb cannot be negative")
    return PrefixStore(Path(directory).expanduser() if directory else prefix_dir(), int(max_gb * 2**30))


def run_cache(argv: list[str]) -> int:
    """`cpchat cache list|clear`: the prefixes the ranks on this machine saved."""
    import time

    from cpchat.format import human_bytes

    p = argparse.ArgumentParser(prog="cpchat cache", description="The prefixes local ranks saved on disk.")
    p.add_argument("action", choices=("list", "clear"))
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="(default: <user cache dir>/cpchat/prefix)")
    args = p.parse_args(argv)
    store = prefix_store(args.cache_dir, None)
    if args.action == "clear":
        freed = store.clear()
        print(f"removed the saved prefixes in {store.root} ({human_bytes(freed)})")
        return EXIT_OK
    entries = sorted(store.entries(), key=lambda e: e.path.stat().st_mtime, reverse=True)
    if not entries:
        print(f"no saved prefixes in {store.root}")
        return EXIT_OK
    print(f"{'prefix':<12}  {'rank':>6}  {'tokens':>9}  {'size':>9}  {'last used':<16}  model")
    for e in entries:
        h = e.header
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.path.stat().st_mtime))
        print(f"{h['prefix_id'][:12]:<12}  {h['shard']:>2} of {h['num_ranks']:<2} {h['tokens']:>9,}  "
              f"{human_bytes(e.size):>9}  {used:<16}  {h['model']}")
    total = sum(e.size for e in entries)
    print(f"{len(entries)} files, {human_bytes(total)}, in {store.root}")
    return EXIT_OK


def use_blas(choice: str, threads: int, argv: list[str]) -> None:
    """Re-execute this rank with the chosen BLAS preloaded and its threads set, unless it already
    has them (see cpchat/blas.py)."""
    env = blas.thread_environment(threads, blas.preload_environment(choice))
    blas.rerun_preloaded(["-m", "cpchat", "rank", *argv], env)


def run_rank(argv: list[str]) -> int:
    from cpchat.dirs import measure_dir
    from cpchat.rank.measures import MeasureStore
    from cpchat.rank.server import serve

    args = rank_parser().parse_args(argv)
    try:
        if args.cpu is not None:
            os.sched_setaffinity(0, {args.cpu})
        use_blas(args.blas, args.threads or blas.shared_threads(args.ranks_here), argv)
        token = read_token(args.token_file) if args.token_file else None
        if not is_loopback(args.host) and token is None:
            raise UsageError(f"binding {args.host} needs --token-file: ranks off loopback must authenticate")
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        if args.tls_cert and not args.tls_ca:
            raise UsageError("--tls-cert needs --tls-ca: ranks verify their next neighbour's certificate")
        memory_limit = memory_size(args.memory_limit)
        serve(
            args.host, args.port, token,
            tls_cert=read_bytes(args.tls_cert, "TLS certificate"),
            tls_key=read_bytes(args.tls_key, "TLS key"),
            tls_ca=read_bytes(args.tls_ca, "CA certificate"),
            parent_pid=args.parent_pid,
            cache=None if args.no_cache else prefix_store(args.cache_dir, args.cache_max_gb),
            measures=MeasureStore(measure_dir(), args.ranks_here),
            memory_limit=memory_limit,
        )
    except (UsageError, BadInput, blas.BlasUnavailable) as e:
        print(f"cpchat rank: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, RuntimeError) as e:
        print(f"cpchat rank: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def memory_size(text: str | None) -> int | None:
    from cpchat.format import parse_size

    try:
        return None if text is None else parse_size(text)
    except ValueError as e:
        raise UsageError(f"--memory-limit: {e}") from None


def print_from_settings(args: argparse.Namespace) -> int:
    """`cpchat --print-config`: every setting, its value, and where the value came from; or
    `--list-models`: the models the picker lists (in the settings' model folders), a table or JSON lines."""
    from cpchat.client.settings import format_config, resolve_settings

    try:
        settings = resolve_settings(args)
    except BadInput as e:
        print(f"cpchat: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not args.list_models:
        print(format_config(settings))
        return EXIT_OK
    import json

    from cpchat.client.models import format_table, local_models, model_dirs

    models = local_models(model_dirs(settings.model_dirs))
    print("\n".join(json.dumps(m.as_json()) for m in models) if args.json else format_table(models))
    return EXIT_OK


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(args.attach, args.hostfile, args.token_file, args.tls_ca, args.transport,
                          args.launch, args.devices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        return run_rank(argv[1:])
    if argv[:1] == ["cache"]:
        try:
            return run_cache(argv[1:])
        except UsageError as e:
            print(f"cpchat cache: {e}", file=sys.stderr)
            return EXIT_USAGE
    if argv[:1] == ["plan"]:
        return run_plan(argv[1:])
    if argv[:1] == ["serve"]:
        return run_serve(argv[1:])
    if argv[:1] == ["bench"]:
        from cpchat.bench import main as bench_main

        return bench_main(argv[1:])
    args = app_parser().parse_args(argv)
    if args.list_architectures:
        from cpchat.rank.catalogue import print_architectures

        return print_architectures()
    if args.list:
        from cpchat.client.conversations import print_conversations
        from cpchat.dirs import data_dir

        return print_conversations(data_dir() / "transcripts")
    if args.print_config or args.list_models:
        return print_from_settings(args)
    if args.headless:
        from cpchat.headless import run_headless

        return run_headless(args, cluster_options(args))
    from cpchat.tui.app import run_app

    return run_app(args, cluster_options(args))


def entry() -> None:
    try:
        code = main()
    except BrokenPipeError:  # whoever read our stdout has gone (`cpchat --list | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and no second error at exit
        code = EXIT_OK
    # Everything is written and the ranks are stopped. The interpreter's teardown of MLX's threads
    # (the front end loads MLX for its K/V formats) can abort ("terminate called without an active
    # exception", exit 134), as a rank's could (rank/server.py): leave without it, as the ranks do.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
