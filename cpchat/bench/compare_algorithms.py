"""`cpchat bench --algorithms`: the prefill algorithms side by side.

For each model variant (one per --kv-heads) and rank count, one cluster runs every listed algorithm on
every context, repeat after repeat in turn, so noise on a busy machine falls on all of them alike. The
report says which algorithm was fastest, which one auto (the cost model, cpchat/core/heuristics.py)
picks from the same cluster's calibration, and how much slower its pick measured than the fastest.
Decode is timed with partial outputs exchanged in one step or passed round the ring, or with rank 0
alone running the model (lead, or gather over every rank's K/V), and each link's
small-message latency is listed, as those are what the cost model weighs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpchat.bench.baseline import prompt_ids
from cpchat.bench.charts import write_ratio_chart
from cpchat.bench.compare_mlx_lm import exchange_wait_ms
from cpchat.bench.models import in_form, random_model, source_model
from cpchat.bench.report import machine, write_report
from cpchat.checkpoints import CheckpointError
from cpchat.client.cluster import Cluster
from cpchat.client.events import AlgorithmChoice, Done, Prefill
from cpchat.client.planner import Planner
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.core.algorithms import DECODE_EXCHANGES, PREFILL_ALGORITHMS, title
from cpchat.core.heuristics import decode_estimates

RUN_ORDER = (*PREFILL_ALGORITHMS, "auto")  # auto last: its column follows those it chooses from


class BenchUsageError(ValueError):
    """A flag combination the comparison cannot run."""


def parse_list(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    """A comma list of known names, in the canonical order; `all` = every known name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(known)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise BenchUsageError(f"{flag}: expected a comma list of {', '.join(known)} (or all), got {text!r}")
    return [n for n in known if n in names]


@dataclass
class Variant:
    """One model the comparison runs on, as its ranks loaded it."""

    model: str  # directory name
    q_heads: int
    kv_heads: int
    blas: str  # the BLAS the ranks report

    @property
    def heads(self) -> str:
        return f"{self.q_heads}:{self.kv_heads}"


@dataclass
class PrefillCell:
    """Every algorithm's prefill of one context on one cluster, and what auto makes of it."""

    variant: Variant
    ranks: int
    context: int
    ttft_ms: dict[str, list[float]] = field(default_factory=dict)  # algorithm -> each repeat's TTFT
    prefill_ms: dict[str, list[float]] = field(default_factory=dict)  # the ranks' own prefill time
    auto_pick: str = ""  # what auto chooses from the cluster's calibration
    auto_reason: str = ""
    estimates_ms: dict[str, float] = field(default_factory=dict)  # the cost model's, per algorithm
    auto_ran: list[str] = field(default_factory=list)  # what the ranks ran under auto, each repeat

    def best_ms(self, algorithm: str) -> float | None:
        times = self.ttft_ms.get(algorithm)
        return min(times) if times else None

    @property
    def fastest(self) -> str | None:
        """The forced algorithm with the least measured TTFT."""
        measured = {a: self.best_ms(a) for a in PREFILL_ALGORITHMS if self.best_ms(a) is not None}
        return min(measured, key=measured.get) if measured else None

    @property
    def auto_gap_pct(self) -> float | None:
        """How much slower auto's pick measured (in its forced runs) than the fastest; None if its pick
        was not among the algorithms run."""
        pick, best = self.best_ms(self.auto_pick), self.fastest
        if pick is None or best is None:
            return None
        return 100 * (pick / self.best_ms(best) - 1)

    def relative_ms(self, algorithm: str) -> float | None:
        """`algorithm`'s best TTFT over the fastest's (1 = fastest); None where either is not measured."""
        value, best = self.best_ms(algorithm), self.best_ms(self.fastest) if self.fastest else None
        return value / best if value is not None and best else None

    @property
    def auto_consistent(self) -> bool:
        """Whether every auto run ran the algorithm auto said it would pick."""
        return all(ran == self.auto_pick for ran in self.auto_ran)

    def to_json(self) -> dict:
        return {**asdict(self), "best_ttft_ms": {a: self.best_ms(a) for a in self.ttft_ms},
                "fastest": self.fastest, "auto_gap_pct": self.auto_gap_pct,
                "auto_consistent": self.auto_consistent}


@dataclass
class DecodeRow:
    """Decode speed with one way of exchanging partial outputs."""

    variant: Variant
    ranks: int
    context: int
    exchange: str  # "exchange" or "ring"
    ms_per_token: list[float] = field(default_factory=list)  # each repeat's, from Done's rate
    generated_tokens: list[int] = field(default_factory=list)
    estimate_ms: float = 0.0  # the cost model's communication time per token
    wait_ms: list[float] = field(default_factory=list)  # each repeat's last step's wait a layer (N > 1)
    overhead_ms: list[float] = field(default_factory=list)  # of it, the exchange's own (exchange_wait_ms)

    @property
    def best(self) -> float | None:
        return min(self.ms_per_token) if self.ms_per_token else None

    def to_json(self) -> dict:
        return {**asdict(self), "best_ms_per_token": self.best}


@dataclass
class Latency:
    """One cluster's measured small-message latencies."""

    variant: Variant
    ranks: int
    link_us: list[list[float]]  # [from rank][to rank], one way
    exchange_us: float  # a small message to every other rank and one from each, at once
    hop_us: float  # the slowest ring link
    ring_gb_s: float


@dataclass
class Comparison:
    command: str
    repeats: int
    decode_tokens: int
    prefill: list[PrefillCell] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    latency: list[Latency] = field(default_factory=list)

    def to_json(self, seconds: float) -> dict:
        return {
            "command": self.command,
            "machine": machine(),
            "blas": sorted({c.variant.blas for c in self.prefill + self.decode}),
            "repeats": self.repeats,
            "decode_tokens": self.decode_tokens,
            "seconds": round(seconds, 1),
            "prefill": [c.to_json() for c in self.prefill],
            "decode": [r.to_json() for r in self.decode],
            "latency": [asdict(lat) for lat in self.latency],
        }


# ---- running


def run_comparison(args, command: str) -> int:
    """The comparison mode of `cpchat bench`; returns the exit status."""
    try:
        algorithms = parse_list(args.algorithms, RUN_ORDER, "--algorithms")
        exchanges = parse_list(args.decode_exchange, DECODE_EXCHANGES, "--decode-exchange")
        models = model_variants(args)
    except BenchUsageError as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    contexts, ranks = args.contexts, args.ranks
    result = Comparison(command, args.repeats, args.decode)
    started = time.time()
    for model in models:
        for n in ranks:
            bench_cluster(result, model, n, contexts, algorithms, exchanges, args)
    out = Path(args.out)
    write_comparison(out, result, time.time() - started)
    print(f"wrote {out / 'results.md'}", file=sys.stderr)
    return 0


def model_variants(args) -> list[Path]:
    """The model directories to compare: --model as it is, or a random llama per --kv-heads."""
    if args.model:
        if args.kv_heads:
            raise BenchUsageError("--kv-heads builds random models: leave out --model")
        try:  # a directory, or a GGUF file, ollama:NAME or smollm2 converted to one
            return [in_form(source_model(args.model, args.hidden, args.layers, args.heads, None, "llama"),
                            args.form)]
        except CheckpointError as e:
            raise BenchUsageError(str(e)) from None
    try:
        kv_list = [int(k) for k in args.kv_heads.split(",") if k] if args.kv_heads else [None]
        models = [random_model(args.hidden, args.layers, args.heads, kv) for kv in kv_list]
    except ValueError as e:  # not a number, or not a divisor of the query heads
        raise BenchUsageError(f"--kv-heads {args.kv_heads}: {e}") from e
    return [in_form(model, args.form) for model in models]


def bench_cluster(result: Comparison, model: Path, n: int, contexts: list[int], algorithms: list[str],
                  exchanges: list[str], args) -> None:
    """Everything measured on one cluster of n ranks: it is launched and calibrated once."""
    cluster = Cluster.launch(n, blas_choice=args.blas_choice, pin_cpus=args.pin, threads=args.threads)
    try:
        cluster.connect()
        info = cluster.load(str(model))
        tokenizer = load_tokenizer(str(model))
        blas_label = " / ".join(sorted({r.blas_label for r in cluster.ranks}))
        variant = Variant(model.name, info.num_q_heads, info.num_kv_heads, blas_label)
        if n >= 2:  # on one rank every algorithm is the same computation
            result.latency.append(latency(cluster, variant))
            for context in contexts:
                result.prefill.append(prefill_cell(cluster, tokenizer, variant, context, algorithms,
                                                   args.repeats))
                report_cell(result.prefill[-1])
        for exchange in exchanges:
            result.decode.append(decode_row(cluster, tokenizer, variant, max(contexts), exchange, args))
            report_decode(result.decode[-1])
    finally:
        cluster.close()


def latency(cluster: Cluster, variant: Variant) -> Latency:
    """The latencies the cluster measured when it loaded the model (those auto used)."""
    links = [[1e6 * s for s in row] for row in cluster.link_latency_s]
    return Latency(variant, cluster.size, links, 1e6 * cluster.exchange_latency_s,
                   1e6 * cluster.hop_latency_s, cluster.ring_bytes_per_s / 1e9)


@dataclass
class Run:
    ttft_ms: float
    prefill_ms: float
    ran: str  # the algorithm the ranks report having run
    choice: AlgorithmChoice
    shares: list[int]  # the tokens each rank took


def prefill_once(cluster: Cluster, tokenizer, ids: list[int], algorithm: str, shares: str = "auto") -> Run:
    """One prefill from an empty cache, generating one token only, so the ranks' last algorithm is
    the prefill's."""
    cluster.reset(0)
    session = Session(cluster, tokenizer, raw=True, algorithm=algorithm,
                      sampling=SamplingOptions(max_tokens=1, temperature=0.0), shares=shares)
    ttft = prefill = 0.0
    taken: list[int] = []
    for event in session.generate(ids):
        if isinstance(event, Prefill):
            prefill, taken = event.ms, event.shares
        elif isinstance(event, Done):
            ttft = event.ttft_ms
    ran = "/".join(sorted({s.algorithm for s in cluster.stats_once()}))
    return Run(ttft, prefill, ran, session.last_choice, taken)


def prefill_cell(cluster: Cluster, tokenizer, variant: Variant, context: int, algorithms: list[str],
                 repeats: int) -> PrefillCell:
    ids = prompt_ids(cluster.model.vocab_size, context)
    cell = PrefillCell(variant, cluster.size, context)
    choice = Planner(cluster).choose_algorithm(context, 0)
    cell.auto_pick, cell.auto_reason, cell.estimates_ms = choice.algorithm, choice.reason, choice.estimates_ms
    for _ in range(repeats):  # each repeat runs every algorithm once, so drift falls on all alike
        for algorithm in algorithms:
            run = prefill_once(cluster, tokenizer, ids, algorithm)
            cell.ttft_ms.setdefault(algorithm, []).append(run.ttft_ms)
            cell.prefill_ms.setdefault(algorithm, []).append(run.prefill_ms)
            if algorithm == "auto":
                cell.auto_ran.append(run.ran if run.choice.algorithm == run.ran else
                                     f"{run.ran} (said {run.choice.algorithm})")
    if not cell.auto_consistent:
        print(f"  warning: auto picked {cell.auto_pick} but ran {', '.join(cell.auto_ran)}", file=sys.stderr)
    return cell


def decode_row(cluster: Cluster, tokenizer, variant: Variant, context: int, exchange: str, args) -> DecodeRow:
    """ms per decoded token after a pass-KV prefill of `context` tokens."""
    ids = prompt_ids(cluster.model.vocab_size, context)

    def session() -> Session:
        return Session(cluster, tokenizer, raw=True, algorithm="pass_kv", decode=exchange,
                       sampling=SamplingOptions(max_tokens=args.decode, temperature=0.0))

    probe = Planner(cluster, "pass_kv", exchange)
    estimate = decode_estimates(probe.workload(1, context), probe.measured())[exchange]
    row = DecodeRow(variant, cluster.size, context, exchange, estimate_ms=round(1000 * estimate, 3))
    for _ in range(args.repeats):
        cluster.reset(0)
        done = [e for e in session().generate(ids) if isinstance(e, Done)][0]
        row.generated_tokens.append(done.generated_tokens)
        if done.decode_tokens_per_s > 0:  # 0: fewer than two tokens came (an early stop token)
            row.ms_per_token.append(1000 / done.decode_tokens_per_s)
        if cluster.size > 1 and done.generated_tokens > 1:  # the ranks' last pass is a decode step's
            wait, overhead = exchange_wait_ms(cluster.stats_once(), cluster.model)
            row.wait_ms.append(wait)
            row.overhead_ms.append(overhead)
    return row


def report_cell(cell: PrefillCell) -> None:
    times = ", ".join(f"{title(a)} {cell.best_ms(a):.0f}" for a in cell.ttft_ms)
    gap = f"{cell.auto_gap_pct:.0f}%" if cell.auto_gap_pct is not None else "n/a"
    print(f"  {cell.variant.model} N={cell.ranks} ctx={cell.context}: TTFT ms {times}; "
          f"fastest {cell.fastest}, auto picks {cell.auto_pick} (gap {gap})", file=sys.stderr, flush=True)


def report_decode(row: DecodeRow) -> None:
    best = f"{row.best:.1f} ms/token" if row.best is not None else "no rate (stopped early)"
    print(f"  {row.variant.model} N={row.ranks} ctx={row.context} decode {row.exchange}: {best}",
          file=sys.stderr, flush=True)


# ---- the report


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _head(columns: list[str], rule: str) -> list[str]:
    """A table's header and rule: the key of a cell (model, heads, N, context), then `columns`."""
    return ["| model | heads q:kv | N | context | " + " | ".join(columns) + " |",
            "|---|---|---:|---:|" + rule]


def _key(variant: Variant, ranks: int, context: int) -> str:
    """The start of a row: its cell's key."""
    return f"| {variant.model} | {variant.heads} | {ranks} | {context} | "


def prefill_table(cells: list[PrefillCell]) -> list[str]:
    algorithms = [a for a in RUN_ORDER if any(a in c.ttft_ms for c in cells)]
    lines = _head([*map(title, algorithms), "best", "auto's pick", "auto gap"],
                  "---:|" * len(algorithms) + "---|---|---:|")
    for c in cells:
        times = []
        for a in algorithms:
            mark = "" if a != "auto" or c.auto_consistent else f" (ran {', '.join(c.auto_ran)})"
            times.append(_ms(c.best_ms(a)) + mark)
        gap = f"{c.auto_gap_pct:.1f}%" if c.auto_gap_pct is not None else "n/a"
        best = title(c.fastest) if c.fastest else ""
        lines.append(_key(c.variant, c.ranks, c.context) + " | ".join(times)
                     + f" | {best} | {title(c.auto_pick)} | {gap} |")
    return lines


def estimate_table(cells: list[PrefillCell]) -> list[str]:
    lines = _head([*map(title, PREFILL_ALGORITHMS), "auto's reason"],
                  "---:|" * len(PREFILL_ALGORITHMS) + "---|")
    for c in cells:
        lines.append(_key(c.variant, c.ranks, c.context)
                     + " | ".join(_ms(c.estimates_ms.get(a)) for a in PREFILL_ALGORITHMS)
                     + f" | {c.auto_reason} |")
    return lines


def decode_table(rows: list[DecodeRow]) -> list[str]:
    exchanges = [e for e in DECODE_EXCHANGES if any(r.exchange == e for r in rows)]
    lines = _head([f"{e} ms/token" for e in exchanges] + [f"{e} estimate" for e in exchanges]
                  + [f"{e} wait ms/layer (overhead)" for e in exchanges], "---:|" * (3 * len(exchanges)))
    groups: dict[tuple[str, int], dict[str, DecodeRow]] = {}
    for r in rows:
        groups.setdefault((r.variant.model, r.ranks), {})[r.exchange] = r
    for by_exchange in groups.values():
        first = next(iter(by_exchange.values()))
        measured = [by_exchange.get(e) for e in exchanges]
        lines.append(
            _key(first.variant, first.ranks, first.context)
            + " | ".join(f"{r.best:.1f}" if r and r.best is not None else "" for r in measured) + " | "
            + " | ".join(f"{r.estimate_ms:.2f}" if r else "" for r in measured) + " | "
            + " | ".join(_wait(r) for r in measured) + " |"
        )
    return lines


def _wait(row: DecodeRow | None) -> str:
    """The median repeat's wait a layer and the exchange's own share of it, as the main table shows them."""
    if row is None or not row.wait_ms:
        return ""
    middle = sorted(range(len(row.wait_ms)), key=row.wait_ms.__getitem__)[len(row.wait_ms) // 2]
    return f"{row.wait_ms[middle]:.2f} ({row.overhead_ms[middle]:.2f})"


def latency_table(latencies: list[Latency]) -> list[str]:
    width = max((lat.ranks for lat in latencies), default=0)
    lines = [
        "| model | N | from \\ to | " + " | ".join(str(i) for i in range(width))
        + " | exchange µs | slowest hop µs | ring GB/s |",
        "|---|---:|---:|" + "---:|" * width + "---:|---:|---:|",
    ]
    for lat in latencies:
        for i, row in enumerate(lat.link_us):
            cells = ["—" if i == j else f"{us:.0f}" for j, us in enumerate(row)] + [""] * (width - len(row))
            tail = ([f"{lat.exchange_us:.0f}", f"{lat.hop_us:.0f}", f"{lat.ring_gb_s:.2f}"] if i == 0
                    else [""] * 3)
            lines.append(f"| {lat.variant.model} | {lat.ranks} | {i} | " + " | ".join(cells + tail) + " |")
    return lines


def write_comparison(out: Path, result: Comparison, seconds: float) -> None:
    data = result.to_json(seconds)
    m = data["machine"]
    lines = [
        "# cpchat bench: prefill algorithms",
        "",
        f"Command: `{result.command}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['system']}; BLAS: {', '.join(data['blas'])}; "
        f"mlx {m['mlx']}. Ranks are local processes. Best of {result.repeats} repeat(s), every one in "
        f"results.json; took {seconds:.0f} s.",
    ]
    if result.prefill:
        lines += ["", "## Prefill TTFT, ms", "",
                  "Each algorithm forced on the same cluster; *auto's pick* is what the cost model chooses "
                  "from that cluster's calibration, and *auto gap* is its pick's measured TTFT (from the "
                  "forced runs) over the best one, minus 1. The auto column is auto's own run.", ""]
        lines += prefill_table(result.prefill)
        lines += ["", "## The cost model's estimates, ms", "",
                  "Attention and transfer only (what differs between the algorithms), not a whole TTFT.", ""]
        lines += estimate_table(result.prefill)
    if result.decode:
        lines += ["", f"## Decode, ms per token ({result.decode_tokens} tokens after a pass-KV prefill)", "",
                  "Partial outputs sent to every rank in one step (exchange) or passed round the ring "
                  "(ring), or rank 0 alone running the model and every other rank attending its queries "
                  "(lead) or over every rank's K/V, sent once (gather); the estimates are the cost model's "
                  "communication time per token.", ""]
        lines += decode_table(result.decode)
    if result.latency:
        lines += ["", "## Link latency, µs one way (a small message)", "",
                  "As each cluster measured it when it loaded the model; exchange: a small message to every "
                  "other rank and one from each, at once.", ""]
        lines += latency_table(result.latency)
    write_report(out, "results", lines, data)
    if result.prefill:
        write_ttft_chart(out / "results.png", result.prefill)


def write_ttft_chart(path: Path, cells: list[PrefillCell]) -> None:
    """Each cell's TTFT per algorithm relative to its fastest (1 = fastest), auto's pick outlined."""
    algorithms = [a for a in PREFILL_ALGORITHMS if any(a in c.ttft_ms for c in cells)]
    write_ratio_chart(path, [f"{c.variant.heads}\nN={c.ranks}\n{c.context}" for c in cells],
                      {title(a): [c.relative_ms(a) for c in cells] for a in algorithms},
                      [title(c.auto_pick) for c in cells], "TTFT / fastest (outlined: auto's pick)")
