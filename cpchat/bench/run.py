"""The benchmark driver: generation over growing contexts for N ranks next to
mlx-lm, the ring transport next to mx.distributed, a Markdown table and a chart.

Every figure is a ratio or a rate measured in the same run, on the same model
and prompt, so a noisy machine shifts both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpchat import blas
from cpchat.bench.baseline import document_ids, prompt_ids
from cpchat.bench.wirefloor import floor_rates
from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.resolve import DownloadLines, is_checkpoint, model_dir
from cpchat.client.cluster import TRANSPORTS, Cluster
from cpchat.client.events import Done, Prefill
from cpchat.client.launcher import rank_environment
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.client.settings import REPO_ASSETS
from cpchat.core.algorithms import ALGORITHMS
from cpchat.dirs import cache_dir
from cpchat.protocol import cpchat_pb2 as pb

MB = 1 << 20
# Per linear layer, the head counts and sizes of released hybrids (Qwen3.5's Gated DeltaNet: 16 key and 32
# value heads of 128; Nemotron-H's Mamba-2: heads of 64 over a 128-wide state), at any --hidden.
BENCH_ARCHS = {
    "llama": {},
    "qwen3_5": {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "full_attention_interval": 4},
    "nemotron_h": {"mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8},
}


@dataclass
class Row:
    system: str
    ranks: int
    context: int
    ttft_ms: list[float] = field(default_factory=list)
    prefill_tokens_per_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    kv_bytes_per_rank: int = 0
    peak_bytes_per_rank: int = 0
    algorithm: str = ""
    hidden_share: float | None = None
    blas: str = ""  # the BLAS that was measured, as the processes report it
    estimate_s: float | None = None  # the prefill time cpchat predicted from the ranks' calibration
    combine_share: float | None = None  # of prefill: linear layers' halo exchange and state combine

    def best(self, name: str) -> float:
        values = getattr(self, name)
        return (min if name == "ttft_ms" else max)(values) if values else 0.0

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpchat bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a small preset that finishes in about two minutes")
    p.add_argument("--model", help="mlx-lm model directory, GGUF file, ollama:NAME or smollm2 (default: a "
                                    "random llama of --hidden/--layers); a real model is prompted with prose")
    p.add_argument("--arch", default="llama", choices=BENCH_ARCHS,
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
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384", help="comma-separated prompt lengths")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    p.add_argument("--decode", type=int, default=16, help="tokens to generate per run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each measurement: TTFT keeps the best, the transport rows the median")
    p.add_argument("--algorithm", default="pass_kv", choices=list(ALGORITHMS))
    p.add_argument("--algorithms", metavar="LIST",
                   help="compare prefill algorithms instead of mlx-lm: a comma list of "
                        "pass_kv,pass_q,all_gather,ulysses,auto, or all")
    p.add_argument("--decode-exchange", default="exchange", metavar="LIST",
                   help="with --algorithms: decode exchanges to time, a comma list of exchange,ring")
    p.add_argument("--pin", action="store_true", help="pin rank i to core i (and mlx-lm to core 0)")
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
    out = REPO_ASSETS / "bench" if REPO_ASSETS.is_dir() else Path("cpchat-bench")  # a checkout, or here
    p.add_argument("--out", default=str(out), help="where results.md/.json/.png go")
    p.add_argument(
        "--attention",
        metavar="LENGTHS",
        help="only time partial_attention against the fused kernel at these lengths (e.g. 4096,16384)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.attention:
        return attention_only([int(n) for n in args.attention.split(",")])
    try:
        blas_modes = blas_choices(args.blas)
    except blas.BlasUnavailable as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    if args.quick:
        args.hidden, args.layers, args.contexts, args.ranks = 256, 4, "512,1024", "1,2"
        args.repeats, args.decode, args.transport = 1, 8, "1,16"
    if args.algorithms:
        if len(blas_modes) > 1:
            print("cpchat bench: --algorithms runs one BLAS; compare BLAS without it", file=sys.stderr)
            return 2
        from cpchat.bench.algorithms import run_comparison  # it imports this module

        args.blas_choice = blas_modes[0]
        return run_comparison(args, command_line(argv))
    kv_heads = int(args.kv_heads) if args.kv_heads and args.kv_heads.isdigit() else None
    if args.kv_heads and kv_heads is None:
        print("cpchat bench: several --kv-heads need --algorithms", file=sys.stderr)
        return 2
    if args.model and is_checkpoint(args.model):  # a GGUF file, ollama:NAME or a named model (smollm2)
        try:
            source = model_dir(args.model, report=DownloadLines())
        except CheckpointError as e:
            print(f"cpchat bench: {e}", file=sys.stderr)
            return 2
    else:
        source = Path(args.model) if args.model else bench_model(args.hidden, args.layers, args.heads,
                                                                 kv_heads, args.arch)
    model = str(in_form(source, args.form))
    contexts = [int(c) for c in args.contexts.split(",") if c]
    ranks = [int(n) for n in args.ranks.split(",") if n]
    planes = [t.strip() for t in args.data_planes.split(",") if t.strip()]
    if not planes or any(t not in TRANSPORTS for t in planes):
        print(f"cpchat bench: --data-planes: expected a comma list of {', '.join(TRANSPORTS)}",
              file=sys.stderr)
        return 2
    rows: list[Row] = []
    started = time.time()
    for blas_choice in blas_modes:
        if not args.no_baseline:
            for context in contexts:
                rows.append(run_baseline(model, context, args, blas_choice))
                report_progress(rows[-1])
        for n in ranks:
            for data_plane in planes if n > 1 else planes[:1]:
                rows.extend(run_cpchat(model, n, contexts, args, blas_choice, data_plane))
    sizes = [int(s) * MB for s in args.transport.split(",") if s]
    transport = run_transport(sizes, args.repeats) if sizes else []
    out = Path(args.out)
    write_report(out, rows, transport, args, model, time.time() - started)
    print(f"wrote {out / 'results.md'}", file=sys.stderr)
    return 0


def command_line(argv: list[str] | None) -> str:
    """The command as typed, for the report."""
    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    return ("cpchat bench " + shlex.join(argv)).strip()


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
        env=rank_environment(),
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


def ring_link(cluster: Cluster, probe_bytes: int, rounds: int = 3) -> tuple[float, float]:
    """(bytes/s of the slowest ring link for blocks of probe_bytes, the slowest link's one-way
    latency for a small message in seconds), as the ranks measure them together."""
    request = pb.CalibrateRequest(probe_bytes=probe_bytes, rounds=rounds)
    calls = [
        r.control.Calibrate.future(request, timeout=300, metadata=cluster.metadata) for r in cluster.ranks
    ]
    replies = [c.result() for c in calls]
    return (min(r.ring_bytes_per_s for r in replies),
            max(max(r.link_latency_s, default=0.0) for r in replies))


def median_link(cluster: Cluster, probe_bytes: int, repeats: int) -> tuple[float, float]:
    """`ring_link`'s bandwidth and latency, each the median of `repeats` runs of TRANSPORT_ROUNDS
    blocks: one run is a few milliseconds on a machine whose neighbours come and go."""
    runs = [ring_link(cluster, probe_bytes, TRANSPORT_ROUNDS) for _ in range(max(1, repeats))]
    return statistics.median(r for r, _ in runs), statistics.median(lat for _, lat in runs)


def bench_model(hidden: int, layers: int, heads: int | None = None, kv_heads: int | None = None,
                arch: str = "llama") -> Path:
    """A random float32 model of `arch` (cached); a quarter as many KV heads as query heads unless told.
    A hybrid's layers come in fours, three linear and one full attention (nemotron_h: M M M *)."""
    from cpchat.smallmodels import write_model

    heads = heads or max(4, hidden // 64)
    kv_heads = kv_heads or max(1, heads // 4)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    name = f"bench-{arch}-h{hidden}-l{layers}-a{heads}-kv{kv_heads}"
    path = cache_dir() / name
    overrides = dict(BENCH_ARCHS[arch])
    if arch == "nemotron_h":
        overrides["hybrid_override_pattern"] = [("*" if i % 4 == 3 else "M") for i in range(layers)]
    if not (path / "config.json").exists():
        write_model(
            path,
            arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=hidden * 3,
            overrides=overrides,
        )
    return path


def in_form(model: Path, form: str) -> Path:
    """`model` converted with mlx_lm.convert into `form` (cached), as checkpoints are published."""
    from cpchat.smallmodels import convert_model

    if form == "float32":
        return model
    converted = cache_dir() / f"{model.resolve().name}-{form}"
    if not (converted / "config.json").exists():
        convert_model(model, converted, form)
    return converted


def report_progress(row: Row) -> None:
    print(
        f"  {row.system:>12} ctx={row.context:>6} blas={row.blas}: ttft {row.best('ttft_ms'):.0f} ms, "
        f"prefill {row.best('prefill_tokens_per_s'):.0f} tok/s, "
        f"decode {row.best('decode_tokens_per_s'):.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )


def run_baseline(model: str, context: int, args, blas_choice: str) -> Row:
    cmd = [
        sys.executable,
        "-m",
        "cpchat.bench.baseline",
        "--model",
        model,
        "--context",
        str(context),
        "--decode",
        str(args.decode),
        "--repeats",
        str(args.repeats),
    ] + (["--text"] if args.model else [])
    if args.pin:
        cmd = ["taskset", "-c", "0"] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, env=rank_environment(blas_choice), check=True)
    row = Row("mlx-lm", 1, context)
    for line in done.stdout.splitlines():
        r = json.loads(line)
        row.blas = r["blas"]
        row.ttft_ms.append(r["ttft_ms"])
        row.prefill_tokens_per_s.append(r["prefill_tokens_per_s"])
        row.decode_tokens_per_s.append(r["decode_tokens_per_s"])
        row.peak_bytes_per_rank = max(row.peak_bytes_per_rank, r["peak_bytes"])
    return row


def run_cpchat(model: str, n: int, contexts: list[int], args, blas_choice: str, transport: str = "auto"
               ) -> list[Row]:
    cluster = Cluster.launch(n, blas_choice=blas_choice, pin_cpus=args.pin, transport=transport)
    rows = []
    try:
        cluster.connect()
        cluster.load(model)
        tokenizer = load_tokenizer(model)
        bandwidth = ring_link(cluster, 16 * MB)[0] if n > 1 else 0.0
        measured_blas = " / ".join(sorted({r.blas_label for r in cluster.ranks}))
        for context in contexts:
            ids = document_ids(tokenizer, context) if args.model else prompt_ids(cluster.model.vocab_size,
                                                                                 context)
            plane = f" {cluster.transport_label}" if n > 1 and transport != "auto" else ""
            system = f"cpchat N={n}{plane}"
            row = Row(system, n, context, blas=measured_blas,
                      estimate_s=cluster.prefill_cost.seconds(context, 0, n))
            for _ in range(args.repeats):
                cluster.reset(0)
                session = Session(
                    cluster,
                    tokenizer,
                    raw=True,
                    algorithm=args.algorithm,
                    sampling=SamplingOptions(max_tokens=args.decode, temperature=0.0),
                )
                for event in session._generate(ids):
                    if isinstance(event, Prefill):
                        row.prefill_tokens_per_s.append(context / (event.ms / 1000))
                        row.algorithm = event.algorithm
                        if event.linear_layers:
                            row.combine_share = event.state_combine_ms / event.ms
                    elif isinstance(event, Done):
                        row.ttft_ms.append(event.ttft_ms)
                        row.decode_tokens_per_s.append(event.decode_tokens_per_s)
                        row.kv_bytes_per_rank = max(r.kv_bytes for r in event.ranks)
                stats = cluster.stats_once()
                row.peak_bytes_per_rank = max(row.peak_bytes_per_rank, max(s.peak_rss_bytes for s in stats))
            if n > 1 and not args.no_overlap:
                row.hidden_share = hidden_share(cluster, ids, args, bandwidth)
            rows.append(row)
            report_progress(row)
    finally:
        cluster.close()
    return rows


def hidden_share(cluster: Cluster, ids: list[int], args, bandwidth: float) -> float:
    """Share of pass-KV transfer time hidden behind compute in a prefill: 1 - waited / transfer,
    where transfer is each received block's bytes over the measured ring bandwidth."""
    cluster.reset(0)
    session = Session(
        cluster,
        load_tokenizer(cluster.model.name),
        raw=True,
        algorithm="pass_kv",
        sampling=SamplingOptions(max_tokens=1, temperature=0.0),
    )
    list(session._generate(ids))
    waited = transfer = 0.0
    for stats in cluster.stats_once():
        sent = {(t.layer, t.step): t.bytes_sent for t in stats.ring_steps}
        for t in stats.ring_steps:
            if t.step == 0:
                continue
            received = sent.get((t.layer, t.step - 1), 0)  # the block we forward is the one we received
            waited += t.wait_ms / 1000
            transfer += (received or sent.get((t.layer, 0), 0)) / bandwidth
    return max(0.0, 1.0 - waited / transfer) if transfer else 0.0


TRANSPORT_ROUNDS = 10  # blocks timed back to back per size, after one untimed warm-up block


def run_transport(sizes: list[int], repeats: int) -> list[dict]:
    """cpchat's ring over gRPC, shared memory and an mx.distributed group (the median of `repeats`
    runs), next to what those allow (mx.distributed's ring backend, gRPC Python moving ready-made
    bytes, a plain TCP socket); 2 local processes each, both directions busy at once. Each row also
    has the small-message latency."""
    ours: dict[str, dict[int, tuple[float, float]]] = {}
    for transport in ("grpc", "shm", "mlx"):
        cluster = Cluster.launch(2, transport=transport)
        try:
            cluster.connect()
            ours[transport] = {size: median_link(cluster, size, repeats) for size in sizes}
        finally:
            cluster.close()
    mx_rates = mx_distributed_rates(sizes)
    floor = floor_rates(sizes, TRANSPORT_ROUNDS, env=rank_environment())
    results = []
    for size in sizes:
        row = {"block_mib": size // MB}
        for transport, rates in ours.items():
            rate, latency = rates[size]
            row |= {f"{transport}_ring_gb_s": rate / 1e9, f"{transport}_latency_us": latency * 1e6}
        row |= {
            "mx_distributed_gb_s": mx_rates.get(size, 0.0) / 1e9,
            "grpc_bytes_only_gb_s": floor.get("grpc", {}).get(size, 0.0) / 1e9,
            "tcp_socket_gb_s": floor.get("socket", {}).get(size, 0.0) / 1e9,
        }
        results.append(row)
        print(
            f"  ring {size // MB:>3} MiB: cpchat gRPC {row['grpc_ring_gb_s']:.2f} GB/s "
            f"({row['grpc_latency_us']:.0f} µs), shared memory {row['shm_ring_gb_s']:.2f} "
            f"({row['shm_latency_us']:.0f} µs), mx.distributed {row['mlx_ring_gb_s']:.2f} "
            f"({row['mlx_latency_us']:.0f} µs); bytes only: mx.distributed {row['mx_distributed_gb_s']:.2f}, "
            f"gRPC bytes only {row['grpc_bytes_only_gb_s']:.2f}, TCP socket {row['tcp_socket_gb_s']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return results


def mx_distributed_rates(sizes: list[int]) -> dict[int, float]:
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    script = str(Path(__file__).with_name("mxdist.py"))
    cmd = [
        launcher,
        "-n",
        "2",
        "--backend",
        "ring",
        "--",
        sys.executable,
        script,
        ",".join(str(s) for s in sizes),
        str(TRANSPORT_ROUNDS),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=rank_environment())
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("{"))
        return {int(k): v for k, v in json.loads(line).items()}
    except (OSError, StopIteration, subprocess.TimeoutExpired, ValueError):
        print("  mx.distributed comparison unavailable", file=sys.stderr)
        return {}


def write_report(out: Path, rows: list[Row], transport: list[dict], args, model: str, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = "cpchat bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    base = {(r.context, r.blas): r for r in rows if r.system == "mlx-lm"}
    lines = [
        "# cpchat bench",
        "",
        f"Command: `{command.strip()}`  ",
        f"Model: `{Path(model).name}`; {args.repeats} repeat(s), best of them (median in the JSON); "
        f"{args.decode} decoded tokens; {os.cpu_count()} cores; took {seconds:.0f} s."
        if rows
        else f"{os.cpu_count()} cores; took {seconds:.0f} s.",
    ]
    if rows:
        lines += [
            "",
            "| system | BLAS | context | TTFT ms | prefill tok/s | vs mlx-lm | decode tok/s | vs mlx-lm "
            "| KV MiB/rank | peak MiB/rank | hidden comm | state combine | prefill estimate |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for r in rows:
        b = base.get((r.context, r.blas))
        pre_ratio = f"{r.best('prefill_tokens_per_s') / b.best('prefill_tokens_per_s'):.2f}×" if b else ""
        dec_ratio = f"{r.best('decode_tokens_per_s') / b.best('decode_tokens_per_s'):.2f}×" if b else ""
        hidden = f"{100 * r.hidden_share:.0f}%" if r.hidden_share is not None else ""
        combine = f"{100 * r.combine_share:.1f}%" if r.combine_share is not None else ""
        measured_s = r.context / r.best("prefill_tokens_per_s") if r.prefill_tokens_per_s else 0.0
        estimate = ""
        if r.estimate_s and measured_s:  # predicted seconds, and as a multiple of the measured ones
            estimate = f"{r.estimate_s:.2f} s ({r.estimate_s / measured_s:.2f}×)"
        lines.append(
            f"| {r.system} | {r.blas} | {r.context} | {r.best('ttft_ms'):.0f} "
            f"| {r.best('prefill_tokens_per_s'):.0f} | {pre_ratio} | {r.best('decode_tokens_per_s'):.1f} "
            f"| {dec_ratio} | {r.kv_bytes_per_rank / MB:.1f} "
            f"| {r.peak_bytes_per_rank / MB:.0f} | {hidden} | {combine} | {estimate} |"
        )
    if transport:
        lines += [
            "",
            f"Ring transport, GB/s per link: 2 local processes, both directions at once, "
            f"{TRANSPORT_ROUNDS} blocks back to back after a warm-up block, the median of "
            f"{args.repeats} such runs for cpchat's rings. Latency: one way, a small message (half the "
            f"best of 5 round trips), measured beside each row's blocks (the median of the runs).",
            "",
            "| block | cpchat gRPC ring | cpchat shared memory | cpchat mx.distributed (ring backend) "
            "| mx.distributed ring, bytes only | gRPC Python, bytes only | TCP socket "
            "| gRPC latency µs | shared-memory latency µs | mx.distributed latency µs |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {t['block_mib']} MiB | {t['grpc_ring_gb_s']:.2f} | {t['shm_ring_gb_s']:.2f} "
            f"| {t['mlx_ring_gb_s']:.2f} | {t['mx_distributed_gb_s']:.2f} | {t['grpc_bytes_only_gb_s']:.2f} "
            f"| {t['tcp_socket_gb_s']:.2f} | {t['grpc_latency_us']:.0f} | {t['shm_latency_us']:.0f} "
            f"| {t['mlx_latency_us']:.0f} |"
            for t in transport
        ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(
        json.dumps({"command": command, "rows": [asdict(r) for r in rows], "transport": transport}, indent=1)
    )
    if rows:
        write_chart(out / "results.png", rows)


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed (pip install 'cpchat[bench]'): no chart", file=sys.stderr)
        return None
    return plt


def write_chart(path: Path, rows: list[Row]) -> None:
    if (plt := pyplot()) is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(r.system for r in rows):
        mine = [r for r in rows if r.system == system and r.blas == rows[0].blas]
        xs = [r.context for r in mine]
        axes[0].plot(xs, [r.best("prefill_tokens_per_s") for r in mine], marker="o", label=system)
        axes[1].plot(xs, [r.best("decode_tokens_per_s") for r in mine], marker="o", label=system)
    for ax, title in zip(axes, ("prefill tokens/s", "decode tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
