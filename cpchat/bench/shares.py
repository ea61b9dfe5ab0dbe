"""`cpchat bench --shares equal,auto --slow RANK:FRACTION`: ranks of different speeds, for real.

One local rank is held to FRACTION of a core by a CPU quota (cgroup v1's cpu.cfs_quota_us or v2's
cpu.max; Linux, as root), in 10 ms periods so that the load-time calibration's probes, tens of
milliseconds each, see it. The model loads again under the quota (the ranks measure their speed when
they load it), and the same prefill runs with each --shares mode (equal always among them). The
ideal is the total work over the total speed: the prefill on the ranks before the quota, with equal
shares, times N / (N - 1 + r), where r, the slow rank's speed over the others', is measured rather
than taken from FRACTION (the quota costs more than its share: its periods, the rank's other threads):
with equal shares the slow rank sets the time, so r = TTFT before the quota / TTFT under it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpchat.bench.baseline import prompt_ids
from cpchat.bench.charts import write_bar_chart
from cpchat.bench.compare_algorithms import BenchUsageError, model_variants, prefill_once
from cpchat.bench.report import machine, write_report
from cpchat.client.cluster import Cluster
from cpchat.client.session import load_tokenizer
from cpchat.client.settings import parse_shares

PERIOD_US = 10_000
CGROUPS = Path("/sys/fs/cgroup")


@dataclass
class SharesRow:
    ranks: int
    context: int
    slow: str  # "RANK:FRACTION"
    unthrottled_ms: float  # equal shares before the quota
    ttft_ms: dict[str, float] = field(default_factory=dict)  # per --shares mode, under the quota
    taken: dict[str, list[int]] = field(default_factory=dict)  # the tokens each rank took, per mode
    speeds: list[float] = field(default_factory=list)  # tokens/s each rank measured under the quota

    @property
    def speed_ratio(self) -> float:
        """The slow rank's speed over the others', as the equal-shares prefills measured it."""
        return self.unthrottled_ms / self.ttft_ms["equal"]

    @property
    def ideal_ms(self) -> float:
        return self.unthrottled_ms * self.ranks / (self.ranks - 1 + self.speed_ratio)


@contextmanager
def cpu_quota(pid: int, fraction: float) -> Iterator[None]:
    """Hold process `pid` (all its threads) to `fraction` of one core while inside."""
    v1 = CGROUPS / "cpu" / "cpu.cfs_quota_us"
    group = (CGROUPS / "cpu" if v1.exists() else CGROUPS) / f"cpchat-bench-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        raise BenchUsageError(f"--slow needs a CPU cgroup it can create (Linux, as root): {e}") from None
    quota = max(1000, round(fraction * PERIOD_US))
    try:
        if v1.exists():
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        (group.parent / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def run_shares(args, command: str) -> int:
    """The --shares mode of `cpchat bench`; returns the exit status."""
    try:
        modes = [m.strip().replace("/", ",") for m in args.shares.split(",") if m.strip()]  # 2/1: weights
        modes = ["equal", *(m for m in modes if m != "equal")]  # the ideal needs it
        for mode in modes:
            parse_shares(mode)
        rank_text, _, fraction_text = (args.slow or "").partition(":")
        slow, fraction = int(rank_text), float(fraction_text)
        if not 0 < fraction < 1:
            raise ValueError
        (model,) = model_variants(args)[:1]
    except ValueError:
        print("cpchat bench: --shares takes modes like equal,auto,2/1 and --slow RANK:FRACTION with "
              "0 < FRACTION < 1", file=sys.stderr)
        return 2
    except BenchUsageError as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    rows: list[SharesRow] = []
    started = time.time()
    for n in [r for r in args.ranks if r > slow]:
        cluster = Cluster.launch(n, blas_choice=args.blas_choice, threads=args.threads)
        try:
            cluster.connect()
            cluster.load(str(model))
            tokenizer = load_tokenizer(str(model))
            best = {c: best_run(cluster, tokenizer, c, "equal", args.repeats)[0] for c in args.contexts}
            try:
                with cpu_quota(cluster.ranks[slow].local.process.pid, fraction):
                    cluster.load(str(model))
                    for context in args.contexts:
                        row = SharesRow(n, context, args.slow, best[context],
                                  speeds=[round(s) for s in cluster.speeds()])
                        for mode in modes:
                            row.ttft_ms[mode], row.taken[mode] = best_run(cluster, tokenizer, context, mode,
                                                                          args.repeats)
                        rows.append(row)
                        report(row)
            except BenchUsageError as e:
                print(f"cpchat bench: {e}", file=sys.stderr)
                return 2
        finally:
            cluster.close()
    out = Path(args.out)
    write_shares(out, rows, command, time.time() - started)
    print(f"wrote {out / 'shares.md'}", file=sys.stderr)
    return 0


def best_run(cluster: Cluster, tokenizer, context: int, mode: str, repeats: int) -> tuple[float, list[int]]:
    """The least TTFT of `repeats` prefills of `context` tokens under --shares `mode`, and its shares."""
    ids = prompt_ids(cluster.model.vocab_size, context)
    runs = [prefill_once(cluster, tokenizer, ids, "pass_kv", mode) for _ in range(repeats)]
    fastest = min(runs, key=lambda r: r.ttft_ms)
    return round(fastest.ttft_ms, 1), fastest.shares


def report(row: SharesRow) -> None:
    times = ", ".join(f"{mode} {ms / 1000:.1f} s {row.taken[mode]}" for mode, ms in row.ttft_ms.items())
    print(f"  N={row.ranks} ctx={row.context} rank {row.slow}: {times}; ideal {row.ideal_ms / 1000:.1f} s",
          file=sys.stderr, flush=True)


def shares_table(rows: list[SharesRow]) -> list[str]:
    modes = list(rows[0].ttft_ms) if rows else []
    lines = ["| N | context | slow rank | speeds tok/s | speed ratio | unthrottled | ideal | "
             + " | ".join(f"{m} TTFT | {m} tokens | {m} / ideal" for m in modes) + " | equal / auto |",
             "|---:|---:|---|---|---:|---:|---:|" + "---:|---|---:|" * len(modes) + "---:|"]
    for r in rows:
        cells = [f"{r.ttft_ms[m] / 1000:.2f} s | {r.taken[m]} | {r.ttft_ms[m] / r.ideal_ms:.2f}"
                 for m in modes]
        both = {"equal", "auto"} <= r.ttft_ms.keys()
        gain = f"{r.ttft_ms['equal'] / r.ttft_ms['auto']:.2f}" if both else ""
        lines.append(f"| {r.ranks} | {r.context} | {r.slow} | {r.speeds} | {r.speed_ratio:.2f} | "
                     f"{r.unthrottled_ms / 1000:.2f} s | "
                     f"{r.ideal_ms / 1000:.2f} s | " + " | ".join(cells) + f" | {gain} |")
    return lines


def write_shares(out: Path, rows: list[SharesRow], command: str, seconds: float) -> None:
    lines = [f"`{command}` ({seconds:.0f} s)", "", *shares_table(rows), "",
             "Ideal: the total work over the total speed, the unthrottled equal-shares TTFT × N / "
             "(N − 1 + r), r the speed ratio (unthrottled over throttled equal-shares TTFT). Speeds: "
             "tokens/s each rank measured when it loaded the model under the quota. TTFT is the best of the "
             "repeats."]
    rows_json = [asdict(r) | {"ideal_ms": r.ideal_ms, "speed_ratio": r.speed_ratio} for r in rows]
    write_report(out, "shares", lines, {"machine": machine(), "command": command, "rows": rows_json})
    groups = [f"N={r.ranks} {r.context // 1024}K" for r in rows]
    bars = {"ideal": [r.ideal_ms / 1000 for r in rows]} | {
        mode: [r.ttft_ms[mode] / 1000 for r in rows] for mode in (rows[0].ttft_ms if rows else {})}
    write_bar_chart(out / "shares.png", groups, bars, "TTFT, s")
