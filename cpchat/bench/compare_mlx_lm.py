"""`cpchat bench`'s default run: generation over growing contexts for N ranks next to mlx-lm's own
stream_generate, then the ring transport next to mx.distributed; a Markdown table, the JSON and a chart.

Every figure is a ratio or a rate measured in the same run, on the same model and prompt, so a noisy
machine shifts both sides alike; cpchat's clusters (one per rank count and data plane) stay up
together and take turns, repeat by repeat.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpchat import blas
from cpchat.bench.baseline import document_ids, prompt_ids
from cpchat.bench.charts import Lines, write_context_chart
from cpchat.bench.models import in_form, source_model
from cpchat.bench.report import machine, write_report
from cpchat.bench.transport import MB, ring_link, run_transport, transport_table
from cpchat.checkpoints import CheckpointError
from cpchat.client.cluster import TRANSPORTS, Cluster
from cpchat.client.events import Done, Prefill
from cpchat.client.launcher import rank_environment
from cpchat.client.plan import make_plan
from cpchat.client.planner import Planner
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.core.quantized_kv import BITS, FULL_PRECISION, KVFormat
from cpchat.core.stages import Stages


@dataclass
class SystemRow:
    system: str
    ranks: int
    context: int
    ttft_ms: list[float] = field(default_factory=list)
    prefill_tokens_per_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    kv_bytes_per_rank: int = 0
    peak_bytes_per_rank: int = 0
    algorithm: str = ""
    kv_bits: int = 0  # K/V quantized to this many bits (--kv-bits), 0: the model's dtype
    ring_bytes: int = 0  # sent by all ranks in a pass-KV prefill's last pass (with --kv-bits: quantized)
    hidden_share: float | None = None
    blas: str = ""  # the BLAS that was measured, as the processes report it
    threads: int = 0  # BLAS threads of each process (mlx-lm's one, or each rank), as the library reports
    estimate_s: float | None = None  # the prefill time cpchat predicted from the ranks' calibration
    peak_estimate_bytes: float | None = None  # `cpchat plan`'s peak per rank, predicted before the runs
    decode_estimate: float | None = None  # and its decode tokens/s
    combine_share: float | None = None  # of prefill: linear layers' halo exchange and state combine
    sgemm_share: float | None = None  # prefill FLOP/s over the rate the ranks' cores reach in sgemm
    exchange_wait_ms: float | None = None  # a decode step's wait for the other ranks, per attention layer
    exchange_overhead_ms: float | None = None  # of it, what the exchange itself costs (exchange_wait_ms)
    decode_step: str = ""  # how the ranks ran the decode steps: exchange, ring, lead or gather
    weight_bytes_per_rank: int = 0  # the most any rank holds, as it reports (stages: its layers')
    bubble_share: float | None = None  # pipeline stages: of the prefill, the longest wait for a stage

    def best(self, name: str) -> float:
        values = getattr(self, name)
        return (min if name == "ttft_ms" else max)(values) if values else 0.0

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0


def run_comparison(args, blas_modes: list[str], command: str) -> int:
    """The default mode of `cpchat bench`, one run per BLAS in `blas_modes`; returns the exit status."""
    kv_heads = int(args.kv_heads) if args.kv_heads and args.kv_heads.isdigit() else None
    if args.kv_heads and kv_heads is None:
        print("cpchat bench: several --kv-heads need --algorithms", file=sys.stderr)
        return 2
    try:
        source = source_model(args.model, args.hidden, args.layers, args.heads, kv_heads, args.arch)
    except CheckpointError as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    model = str(in_form(source, args.form))
    contexts, ranks = args.contexts, args.ranks
    planes = [t.strip() for t in args.data_planes.split(",") if t.strip()]
    if not planes or any(t not in TRANSPORTS for t in planes):
        print(f"cpchat bench: --data-planes: expected a comma list of {', '.join(TRANSPORTS)}",
              file=sys.stderr)
        return 2
    try:
        bits = [int(b) for b in args.kv_bits.split(",")]
    except ValueError:
        bits = []
    formats = [KVFormat(b, args.kv_group_size, args.quantized_kv_start) for b in bits]
    if not formats or any(f.bits not in (0, *BITS) for f in formats):
        print("cpchat bench: --kv-bits: expected a comma list of 0, 8 and 4", file=sys.stderr)
        return 2
    rows: list[SystemRow] = []
    started = time.time()
    for blas_choice in blas_modes:
        for kv in formats:
            if not args.no_baseline:
                for context in contexts:
                    rows.append(run_baseline(model, context, args, blas_choice, kv))
                    report_progress(rows[-1])
            clusters = [(n, plane, p) for n in ranks for plane in (planes if n > 1 else planes[:1])
                        for p in args.stages if n % p == 0]
            rows.extend(run_cpchat(model, clusters, contexts, args, blas_choice, kv))
    sizes = [s * MB for s in args.transport]
    transport = run_transport(sizes, args.repeats) if sizes else []
    out = Path(args.out)
    write_results(out, rows, transport, args, model, command, time.time() - started)
    print(f"wrote {out / 'results.md'}", file=sys.stderr)
    return 0


def report_progress(row: SystemRow) -> None:
    print(
        f"  {row.system:>12} ctx={row.context:>6} blas={row.blas}: ttft {row.best('ttft_ms'):.0f} ms, "
        f"prefill {row.best('prefill_tokens_per_s'):.0f} tok/s, "
        f"decode {row.best('decode_tokens_per_s'):.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )


def run_baseline(model: str, context: int, args, blas_choice: str,
                 kv: KVFormat = FULL_PRECISION) -> SystemRow:
    """mlx-lm's row: baseline.py in a child with the ranks' BLAS environment."""
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
        "--kv-bits",
        str(kv.bits),
        "--kv-group-size",
        str(kv.group_size),
        "--quantized-kv-start",
        str(kv.start),
    ] + (["--text"] if args.model else [])
    if args.pin:
        cmd = ["taskset", "-c", "0"] + cmd
    threads = args.threads or (1 if args.pin else blas.usable_cores())  # every core, as a user's mlx-lm
    done = subprocess.run(cmd, capture_output=True, text=True, env=rank_environment(blas_choice, threads),
                          check=True)
    row = SystemRow("mlx-lm" + _kv_label(kv), 1, context, kv_bits=kv.bits)
    for line in done.stdout.splitlines():
        r = json.loads(line)
        row.blas, row.threads = r["blas"], r["threads"]
        row.ttft_ms.append(r["ttft_ms"])
        row.prefill_tokens_per_s.append(r["prefill_tokens_per_s"])
        row.decode_tokens_per_s.append(r["decode_tokens_per_s"])
        row.peak_bytes_per_rank = max(row.peak_bytes_per_rank, r["peak_bytes"])
        row.kv_bytes_per_rank = r["kv_bytes"]
    return row


def _kv_label(kv: KVFormat) -> str:
    return f" kv{kv.bits}" if kv.quantized else ""


@dataclass
class Contestant:
    """One cluster of the comparison, up for the whole of it."""

    n: int
    transport: str
    cluster: Cluster
    bandwidth: float

    @property
    def system(self) -> str:
        plane = f" {self.cluster.transport_label}" if self.n > 1 and self.transport != "auto" else ""
        stages = f" P={self.cluster.stages}" if self.cluster.stages > 1 else ""
        return f"cpchat N={self.n}{stages}{plane}{_kv_label(self.cluster.model.kv_format)}"


def run_cpchat(model: str, clusters: list[tuple[int, str, int]], contexts: list[int], args,
               blas_choice: str, kv: KVFormat = FULL_PRECISION) -> list[SystemRow]:
    """cpchat's rows, one per cluster (n ranks, transport, pipeline stages) and context. Every cluster
    stays up while the repeats go round them in turn, so the machine's noise falls on all of them alike
    and their ratios are side by side."""
    contestants: list[Contestant] = []
    rows = []
    try:
        for n, transport, stages in clusters:
            cluster = Cluster.launch(n, blas_choice=blas_choice, pin_cpus=args.pin, transport=transport,
                                     threads=args.threads)
            contestants.append(Contestant(n, transport, cluster, 0.0))
            cluster.connect()
            cluster.load(model, kv_format=kv, stages=Stages(stages))
            contestants[-1].bandwidth = ring_link(cluster, 16 * MB)[0] if n > 1 else 0.0
        tokenizer = load_tokenizer(model)
        weights_flops = linear_flops_per_token(model)
        for context in contexts:
            vocab = contestants[0].cluster.model.vocab_size
            ids = document_ids(tokenizer, context) if args.model else prompt_ids(vocab, context)
            runs = [(c, _planned_row(c, tokenizer, context, args)) for c in contestants]
            for _ in range(args.repeats):
                for c, row in runs:
                    _run_once(c, row, tokenizer, ids, args)
            for c, row in runs:
                flops = weights_flops + attention_flops_per_token(c.cluster.model, context)
                row.sgemm_share = flops * row.best("prefill_tokens_per_s") / (c.n * c.cluster.flops_per_s)
                if c.n > 1 and not args.no_overlap:
                    row.hidden_share, row.ring_bytes = hidden_share(c.cluster, ids, args, c.bandwidth)
                rows.append(row)
                report_progress(row)
    finally:
        for c in contestants:
            c.cluster.close()
    return rows


def _planned_row(c: Contestant, tokenizer, context: int, args) -> SystemRow:
    """A cluster's row for one context, with what `cpchat plan` predicts before the runs."""
    c.cluster.reset(0)
    plan = make_plan(Planner(c.cluster, args.algorithm), context, args.decode)
    return SystemRow(c.system, c.n, context, blas=" / ".join(sorted({r.blas_label for r in c.cluster.ranks})),
               kv_bits=c.cluster.model.kv_format.bits, threads=min(r.blas.threads for r in c.cluster.ranks),
               estimate_s=plan.ttft_s, peak_estimate_bytes=max(r.peak_bytes for r in plan.ranks),
               decode_estimate=plan.decode_tokens_per_s)


def _run_once(c: Contestant, row: SystemRow, tokenizer, ids: list[int], args) -> None:
    """One generation of `ids` on a fresh ring, its figures added to `row`."""
    cluster = c.cluster
    cluster.reset(0)
    sampling = SamplingOptions(max_tokens=args.decode, temperature=0.0)
    session = Session(cluster, tokenizer, raw=True, algorithm=args.algorithm, sampling=sampling)
    for event in session.generate(ids):
        if isinstance(event, Prefill):
            row.prefill_tokens_per_s.append(len(ids) / (event.ms / 1000))
            row.algorithm = event.algorithm
            if event.linear_layers:
                row.combine_share = event.state_combine_ms / event.ms
            if event.stage_wait_ms:
                row.bubble_share = max(event.stage_wait_ms) / event.ms
        elif isinstance(event, Done):
            row.ttft_ms.append(event.ttft_ms)
            row.decode_tokens_per_s.append(event.decode_tokens_per_s)
            row.kv_bytes_per_rank = max(r.kv_bytes for r in event.ranks)
    stats = cluster.stats_once()
    row.peak_bytes_per_rank = max(row.peak_bytes_per_rank, max(s.peak_rss_bytes for s in stats))
    row.weight_bytes_per_rank = max(r.weight_bytes for r in cluster.ranks)
    if c.n > 1 and args.decode > 1:  # the last pass is the last token's decode step
        row.exchange_wait_ms, row.exchange_overhead_ms = exchange_wait_ms(stats, cluster.model)
        row.decode_step = stats[0].algorithm.removeprefix("decode_")


@functools.cache
def linear_flops_per_token(model: str) -> float:
    """2 x the weights of the layers' linear maps (a prefill runs the head on one token only); read
    once per model from its lazily loaded modules."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    def size(m: nn.Module) -> int:
        if isinstance(m, nn.QuantizedLinear):
            return m.weight.size * 32 // m.bits
        return m.weight.size if isinstance(m, nn.Linear) else 0

    loaded, _ = load_model(Path(model), lazy=True)
    weights = sum(size(m) for _, m in loaded.named_modules()) - size(loaded.get("lm_head"))
    return 2.0 * weights


def attention_flops_per_token(served, context: int) -> float:
    """QK and PV of one query over the context/2 keys before it, on average, in every attention layer."""
    return 2.0 * 2 * served.num_q_heads * served.head_dim * context / 2 * served.attention_layers


def exchange_wait_ms(stats, served) -> tuple[float, float]:
    """A decode step's wait for the other ranks' partial outputs, per attention layer, averaged over
    the ranks that wait for them (every rank in an exchange, rank 0 in a lead step): the exchange's
    latency and the ranks' skew (and in a lead step, the other ranks' attention). And of that wait,
    the exchange's own overhead: each layer's wait less how much longer the slowest other rank's
    attention took than the waiting rank's own (what a zero-latency exchange would still wait)."""
    attention = [{t.layer: t.compute_ms for t in s.ring_steps if t.step == 0} for s in stats]
    waits, overheads = [], []
    for rank, s in enumerate(stats):
        waited = {t.layer: t.wait_ms for t in s.ring_steps if t.step > 0}
        if not waited:
            continue
        skew = sum(max([0.0] + [a[layer] - attention[rank].get(layer, 0.0)
                                for other, a in enumerate(attention) if other != rank and layer in a])
                   for layer in waited)
        waits.append(sum(waited.values()) / served.attention_layers)
        overheads.append(max(sum(waited.values()) - skew, 0.0) / served.attention_layers)
    if not waits:
        return 0.0, 0.0
    return sum(waits) / len(waits), sum(overheads) / len(overheads)


def hidden_share(cluster: Cluster, ids: list[int], args, bandwidth: float) -> tuple[float, int]:
    """Share of pass-KV transfer time hidden behind compute in a prefill: 1 - waited / transfer,
    where transfer is each received block's bytes over the measured ring bandwidth; and the bytes
    the ranks sent."""
    cluster.reset(0)
    session = Session(
        cluster,
        load_tokenizer(cluster.model.name),
        raw=True,
        algorithm="pass_kv",
        sampling=SamplingOptions(max_tokens=1, temperature=0.0),
    )
    list(session.generate(ids))
    waited = transfer = 0.0
    every = cluster.stats_once()
    for stats in every:
        sent = {(t.layer, t.step): t.bytes_sent for t in stats.ring_steps}
        for t in stats.ring_steps:
            if t.step == 0:
                continue
            received = sent.get((t.layer, t.step - 1), 0)  # the block we forward is the one we received
            waited += t.wait_ms / 1000
            transfer += (received or sent.get((t.layer, 0), 0)) / bandwidth
    sent = sum(t.bytes_sent for s in every for t in s.ring_steps)
    return (max(0.0, 1.0 - waited / transfer) if transfer else 0.0), sent


def write_results(out: Path, rows: list[SystemRow], transport: list[dict], args, model: str, command: str,
                  seconds: float) -> None:
    base = {(r.context, r.blas, r.kv_bits): r for r in rows if r.system.startswith("mlx-lm")}
    plain = {(r.system.removesuffix(_kv_label(KVFormat(r.kv_bits))), r.context, r.blas): r
             for r in rows if not r.kv_bits}
    lines = [
        "# cpchat bench",
        "",
        f"Command: `{command.strip()}`  ",
        f"Model: `{Path(model).name}`; {args.repeats} repeat(s), best of them (median in the JSON; the "
        "prefill estimate against the median), "
        "cpchat's clusters taking turns; "
        f"{args.decode} decoded tokens; {os.cpu_count()} cores; took {seconds:.0f} s."
        if rows
        else f"{os.cpu_count()} cores; took {seconds:.0f} s.",
    ]
    if rows:
        lines += [
            "",
            "| system | BLAS | threads | context | TTFT ms | prefill tok/s | vs mlx-lm | decode tok/s "
            "| vs mlx-lm | KV MiB/rank | vs kv none | ring MiB | peak MiB/rank | weights MiB/rank "
            "| stage wait | hidden comm | state combine | of sgemm rate "
            "| decode step: wait ms/layer (exchange overhead) | prefill estimate | peak estimate "
            "| decode estimate |",
            "|---|---|" + "---:|" * 20,
        ]
    for r in rows:
        b = base.get((r.context, r.blas, r.kv_bits))
        p = plain.get((r.system.removesuffix(_kv_label(KVFormat(r.kv_bits))), r.context, r.blas))
        kv_ratio = f"{r.kv_bytes_per_rank / p.kv_bytes_per_rank:.3f}×" \
            if r.kv_bits and p and p.kv_bytes_per_rank else ""
        pre_ratio = f"{r.best('prefill_tokens_per_s') / b.best('prefill_tokens_per_s'):.2f}×" if b else ""
        dec_ratio = f"{r.best('decode_tokens_per_s') / b.best('decode_tokens_per_s'):.2f}×" if b else ""
        hidden = f"{100 * r.hidden_share:.0f}%" if r.hidden_share is not None else ""
        combine = f"{100 * r.combine_share:.1f}%" if r.combine_share is not None else ""
        bubble = f"{100 * r.bubble_share:.0f}%" if r.bubble_share is not None else ""
        weights = f"{r.weight_bytes_per_rank / MB:.0f}" if r.weight_bytes_per_rank else ""
        sgemm = f"{100 * r.sgemm_share:.0f}%" if r.sgemm_share is not None else ""
        wait = "" if r.exchange_wait_ms is None \
            else f"{r.decode_step}: {r.exchange_wait_ms:.2f} ({r.exchange_overhead_ms:.2f})"
        measured_s = r.context / r.median("prefill_tokens_per_s") if r.prefill_tokens_per_s else 0.0
        estimate = ""
        if r.estimate_s and measured_s:  # predicted seconds, as a multiple of the typical (median) prefill
            estimate = f"{r.estimate_s:.2f} s ({r.estimate_s / measured_s:.2f}×)"
        peak = f"{r.peak_estimate_bytes / MB:.0f} ({r.peak_estimate_bytes / r.peak_bytes_per_rank:.2f}×)" \
            if r.peak_estimate_bytes and r.peak_bytes_per_rank else ""
        best_decode = r.best("decode_tokens_per_s")
        decode = f"{r.decode_estimate:.1f} ({r.decode_estimate / best_decode:.2f}×)" \
            if r.decode_estimate and best_decode else ""
        lines.append(
            f"| {r.system} | {r.blas} | {r.threads} | {r.context} | {r.best('ttft_ms'):.0f} "
            f"| {r.best('prefill_tokens_per_s'):.0f} | {pre_ratio} | {r.best('decode_tokens_per_s'):.1f} "
            f"| {dec_ratio} | {r.kv_bytes_per_rank / MB:.1f} | {kv_ratio} | {r.ring_bytes / MB:.1f} "
            f"| {r.peak_bytes_per_rank / MB:.0f} | {weights} | {bubble} | {hidden} | {combine} | {sgemm} "
            f"| {wait} | {estimate} "
            f"| {peak} | {decode} |"
        )
    if transport:
        lines += ["", *transport_table(transport, args.repeats)]
    write_report(out, "results", lines, {"command": command, "machine": machine(),
                                          "rows": [asdict(r) for r in rows], "transport": transport})
    if rows:
        write_context_chart(out / "results.png", chart_panels(rows))


def chart_panels(rows: list[SystemRow]) -> dict[str, Lines]:
    """Prefill and decode tokens/s, one line per system, of the first BLAS measured."""
    panels: dict[str, Lines] = {"prefill tokens/s": {}, "decode tokens/s": {}}
    for system in dict.fromkeys(r.system for r in rows):
        mine = [r for r in rows if r.system == system and r.blas == rows[0].blas]
        xs = [r.context for r in mine]
        panels["prefill tokens/s"][system] = (xs, [r.best("prefill_tokens_per_s") for r in mine])
        panels["decode tokens/s"][system] = (xs, [r.best("decode_tokens_per_s") for r in mine])
    return panels
