"""`cpchat bench --prefix-cache`: what reading a document once saves a later session.

For each context T and rank count N, on a fresh temporary cache directory: a first session on fresh
ranks asks about a document of about T tokens, once with the save on and once with it off (the
difference is the disk write's cost on that turn); the ranks are shut down, which finishes their
writes; then new ranks on the same directory answer a different question about the same document in a
second session, which loads the saved prefix and prefills only the rest. The report gives the second
TTFT as a share of the first, the load time, and the bytes each rank keeps on disk.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpchat.bench.charts import write_bar_chart
from cpchat.bench.models import in_form, source_model
from cpchat.bench.report import machine, write_report
from cpchat.checkpoints import CheckpointError
from cpchat.client.cluster import Cluster
from cpchat.client.documents import Document, Section
from cpchat.client.events import Done, Prefill, Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.client.settings import bundled, demo_model
from cpchat.errors import BadInput

FIRST_QUESTION = "What is this document about?"
SECOND_QUESTION = "Which access code does the document mention, and for what?"
KVP_SUFFIX = ".kvp"  # a rank's shard file: <prefix id>-<shard>-of-<N>.kvp (cpchat/rank/prefix_cache.py)


@dataclass
class Turn:
    """One session's first turn, as the client saw it."""

    ttft_ms: float  # Done's: from the request to the first token, a disk load included
    wall_ms: float  # from the request to Done, decode included
    tail_ms: float  # from the last token to Done: where the ranks capture their shard for the save
    prompt_tokens: int
    cache: str = "none"  # the Prefill event's: where the reused tokens came from
    reused_tokens: int = 0
    new_tokens: int = 0  # prefilled
    load_ms: float = 0.0  # finding and loading the saved prefix


@dataclass
class Trial:
    """One repeat of the three sessions, on its own cache directory."""

    save_off: Turn  # first session, nothing saved
    save_on: Turn  # first session, the ranks save their shards
    write_wait_ms: float  # after save_on's Done, until every rank's file was written (FindPrefixes)
    second: Turn  # new ranks, same document, another question
    disk_bytes: list[int]  # per shard: its .kvp files after the first session


@dataclass
class Cell:
    """Every repeat at one context and rank count; the report takes each figure's best."""

    model: str
    ranks: int
    context: int
    trials: list[Trial] = field(default_factory=list)

    def best(self, turn: str, name: str) -> float:
        return min(getattr(getattr(t, turn), name) for t in self.trials)

    @property
    def ttft_share(self) -> float:
        """Second TTFT over first (save on)."""
        return self.best("second", "ttft_ms") / self.best("save_on", "ttft_ms")

    @property
    def wall_change(self) -> float:
        """The first turn's wall time, best with the save over best without, minus 1: fresh ranks' noise
        included."""
        return self.best("save_on", "wall_ms") / self.best("save_off", "wall_ms") - 1

    @property
    def save_stall_ms(self) -> float:
        """What the save adds to the turn, measured where it happens: the wait from the last token to
        Done with the save over without (the write itself runs after Done). Free of the first
        turns' noise, which is many times larger."""
        return self.best("save_on", "tail_ms") - self.best("save_off", "tail_ms")

    @property
    def disk_bytes_per_rank(self) -> int:
        return max(max(t.disk_bytes) for t in self.trials)

    def to_json(self) -> dict:
        return {**asdict(self), "ttft_share": self.ttft_share, "wall_change": self.wall_change,
                "save_stall_ms": self.save_stall_ms, "disk_bytes_per_rank": self.disk_bytes_per_rank}


# ---- running


def run_prefix_cache(args, command: str) -> int:
    """The prefix-cache mode of `cpchat bench`; returns the exit status."""
    try:
        model = bench_model(args)
    except CheckpointError as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(str(model))
    contexts, ranks = args.contexts, args.ranks
    started = time.time()
    cells = []
    try:
        for context in contexts:
            document = sample_document(tokenizer, context)
            for n in ranks:
                cell = Cell(model.name, n, context)
                for repeat in range(args.repeats):
                    cell.trials.append(run_trial(model, tokenizer, n, document, args, repeat % 2 == 0))
                cells.append(cell)
                report_cell(cell)
    except BadInput as e:  # e.g. a context past the model's
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_prefix_cache(out, cells, command, args, time.time() - started)
    print(f"wrote {out / 'prefix-cache.md'}", file=sys.stderr)
    return 0


def bench_model(args) -> Path:
    """--model (in --form), or the demo model: trained weights answer prose as a user's model would."""
    if not args.model:
        return in_form(demo_model()[0], args.form)
    return in_form(source_model(args.model, args.hidden, args.layers, args.heads, None, "llama"), args.form)


def sample_document(tokenizer, tokens: int) -> Document:
    """About `tokens` tokens of the sample document, repeated as needed, as an attached text file."""
    text = bundled("sample-doc.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    body = tokenizer.decode(ids)
    return Document("sample-doc.txt", "text", len(body.encode()), (Section("sample-doc.txt", body),))


def run_trial(model: Path, tokenizer, n: int, document: Document, args, off_first: bool) -> Trial:
    """The three sessions on a fresh cache directory; the first session's two runs in alternating order
    from repeat to repeat, so drift falls on both alike."""
    with tempfile.TemporaryDirectory(prefix="cpchat-bench-prefix-") as directory:
        cache = Path(directory)
        first: dict[bool, tuple[Turn, float]] = {}
        for save in (False, True) if off_first else (True, False):
            first[save] = session_turn(model, tokenizer, n, cache, document, FIRST_QUESTION, save, args)
        disk = shard_bytes(cache, n)
        drop_from_page_cache(cache)
        second = session_turn(model, tokenizer, n, cache, document, SECOND_QUESTION, True, args)[0]
    return Trial(first[False][0], first[True][0], first[True][1], second, disk)


def session_turn(model: Path, tokenizer, n: int, cache: Path, document: Document, question: str,
                 prefix_cache: bool, args) -> tuple[Turn, float]:
    """One turn of a new session on fresh ranks keeping prefixes in `cache`; with the prefix cache on,
    also the wait for the ranks' writes after Done (FindPrefixes waits for them), measured before
    the shutdown (which waits for them too, but under a short deadline)."""
    cluster = Cluster.launch(n, blas_choice=args.blas_choice, pin_cpus=args.pin,
                             flags=["--cache-dir", str(cache)], threads=args.threads)
    try:
        cluster.connect()
        cluster.load(str(model))
        session = Session(cluster, tokenizer, prefix_cache=prefix_cache,
                          sampling=SamplingOptions(max_tokens=args.decode, temperature=0.0))
        session.save_min_tokens = 0  # save at any context, so a small run measures the same path
        prepared = session.prepare(question, [document])
        turn = timed_turn(session, prepared)
        waited = time.perf_counter()
        if prefix_cache:
            cluster.find_prefixes(prepared.tokens)
        return turn, 1000 * (time.perf_counter() - waited) if prefix_cache else 0.0
    finally:
        cluster.close()


def timed_turn(session: Session, prepared) -> Turn:
    t0 = t_last = time.perf_counter()
    prefill = done = None
    for event in session.run(prepared):
        if isinstance(event, Prefill):
            prefill = event
        elif isinstance(event, Token):
            t_last = time.perf_counter()
        elif isinstance(event, Done):
            done = event
    t_end = time.perf_counter()
    return Turn(done.ttft_ms, round(1000 * (t_end - t0), 1), round(1000 * (t_end - t_last), 1),
                done.prompt_tokens, prefill.cache, prefill.reused_tokens, prefill.new_tokens, prefill.load_ms)


def shard_bytes(cache: Path, n: int) -> list[int]:
    """Bytes of each shard's .kvp files (`<id>-<shard>-of-<n>.kvp`): what each rank keeps on its disk."""
    sizes = [0] * n
    for path in cache.glob(f"*-of-{n}{KVP_SUFFIX}"):
        shard = int(path.name.rsplit("-of-", 1)[0].rsplit("-", 1)[1])
        sizes[shard] += path.stat().st_size
    return sizes


def drop_from_page_cache(cache: Path) -> None:
    """Ask the kernel to forget the saved files' pages, so the second session reads them from the disk
    rather than from memory the write left them in (advice: a file system may keep them)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in cache.glob(f"*{KVP_SUFFIX}"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def report_cell(cell: Cell) -> None:
    first, second = cell.best("save_on", "ttft_ms"), cell.best("second", "ttft_ms")
    print(f"  {cell.model} N={cell.ranks} ctx={cell.context}: first TTFT {first:.0f} ms, second "
          f"{second:.0f} ms ({100 * cell.ttft_share:.1f}%), load {cell.best('second', 'load_ms'):.0f} ms, "
          f"wall ratio {100 * cell.wall_change:+.1f}%, save stall {cell.save_stall_ms:.0f} ms",
          file=sys.stderr, flush=True)


# ---- the report


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def prefix_cache_table(cells: list[Cell]) -> list[str]:
    lines = ["| model | N | context | prompt tokens | first TTFT ms | second TTFT ms | second / first "
             "| load ms | reused tokens | prefilled | cache | disk MiB/rank | first turn s, save off "
             "| save on | wall ratio − 1 | save stall ms | stall / turn | write done after Done, ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        second = c.trials[0].second
        lines.append(
            f"| {c.model} | {c.ranks} | {c.context} | {second.prompt_tokens} "
            f"| {c.best('save_on', 'ttft_ms'):.0f} | {c.best('second', 'ttft_ms'):.0f} "
            f"| {100 * c.ttft_share:.1f}% | {c.best('second', 'load_ms'):.0f} | {second.reused_tokens} "
            f"| {second.new_tokens} | {second.cache} | {mib(c.disk_bytes_per_rank)} "
            f"| {c.best('save_off', 'wall_ms') / 1000:.2f} | {c.best('save_on', 'wall_ms') / 1000:.2f} "
            f"| {100 * c.wall_change:+.1f}% | {c.save_stall_ms:.0f} "
            f"| {100 * c.save_stall_ms / c.best('save_off', 'wall_ms'):.2f}% "
            f"| {min(t.write_wait_ms for t in c.trials):.0f} |")
    return lines


def write_prefix_cache(out: Path, cells: list[Cell], command: str, args, seconds: float) -> None:
    m = machine()
    blas = args.blas_choice
    lines = [
        "# cpchat bench: prefix cache",
        "",
        f"Command: `{command}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['system']}; mlx {m['mlx']}; --blas {blas}. Ranks are "
        f"local processes sharing one temporary cache directory. Best of {args.repeats} repeat(s), each on "
        f"a fresh directory, every one in prefix-cache.json; {args.decode} tokens decoded per turn; took "
        f"{seconds:.0f} s.",
        "",
        "First session: fresh ranks, the document and a question, the save on (its TTFT is *first TTFT*) "
        "and, on other fresh ranks, off. *First turn s*: its wall time, request to Done, decode included; "
        "*wall ratio − 1*: with the save over without, minus 1, which on fresh ranks carries their noise. "
        "The save's own cost on the turn is *save stall ms*: the time from the last token to Done with "
        "the save over without (the ranks capture their shard there), and *stall / turn* that over the "
        "turn without the save. The file is written on a background thread after Done, finished "
        "*write done after Done* ms later. Second session: new ranks on "
        "the same directory, the same document and another question; its TTFT includes finding and "
        "loading the saved prefix (*load ms*, the saved files' pages dropped from the OS page cache "
        "first) and prefilling the rest. *Disk MiB/rank*: the .kvp files of one shard.",
        "",
        *prefix_cache_table(cells),
    ]
    data = {"command": command, "machine": m, "repeats": args.repeats, "decode_tokens": args.decode,
            "seconds": round(seconds, 1), "cells": [c.to_json() for c in cells]}
    write_report(out, "prefix-cache", lines, data)
    seconds_of = {"first session": "save_on", "second session (prefix from disk)": "second"}
    write_bar_chart(out / "prefix-cache.png", [f"{c.model}\nN={c.ranks}\n{c.context}" for c in cells],
                    {label: [c.best(turn, "ttft_ms") / 1000 for c in cells]
                     for label, turn in seconds_of.items()},
                    "TTFT, s")
