"""`cpchat bench --speculate off,lookup`: decode speed with speculative decoding and without, side by side
on the same ranks and prompt: a question whose answer quotes the attached document and one whose answer
copies nothing, at each context and rank count. The modes take turns, repeat by repeat, on one session
that holds the prompt (a later run prefills only its last token), and their answers must be the same.
With --link-delay-ms every message between the ranks waits that long first: a slower network, simulated."""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cpchat.bench.prefix_cache import bench_model, sample_document
from cpchat.bench.report import machine, write_report
from cpchat.client.cluster import Cluster
from cpchat.client.draft import resolve_speculation
from cpchat.client.events import Done, Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.core.lookup import MAX_DRAFT, SPECULATE, propose, speculation_valid
from cpchat.errors import BadInput
from cpchat.rank.transport.ring import LINK_DELAY_ENV

# The demo model answers one kind of question: a fact the document states (quoted), or one it does not.
DEMO_QUESTIONS = {"quotes": "What is the access code for the Orion vault?",
                  "copies nothing": "What is the launch code for the Zephyr station?"}
PROSE_QUESTIONS = {"quotes": "Quote the sentence about the Orion vault.",
                   "copies nothing": "Write a short poem about the autumn sea, in your own words."}


@dataclass
class SpeculationRow:
    context: int
    ranks: int
    question: str
    mode: str
    decode_tokens_per_s: list[float] = field(default_factory=list)
    answer_tokens: int = 0
    decided: int = 0  # tokens the last run's decode steps decided: the answer's after its first, and its end
    steps: int = 0  # the last run's decode steps
    proposed: int = 0
    accepted: int = 0
    same_answer: bool = True  # as the first mode's
    check_cost: float | None = None  # a proposal's share of a plain step's time, from this row and off's
    best: float | None = None  # the speed-up the best draft lengths would give with these proposals
    answer: list[int] = field(default_factory=list)  # the first run's token ids (with its end, if it ended)

    @property
    def median(self) -> float:
        return statistics.median(self.decode_tokens_per_s) if self.decode_tokens_per_s else 0.0


def run_speculation(args, command: str) -> int:
    modes = [m.strip() for m in args.speculate.split(",") if m.strip()]
    if not modes or not all(speculation_valid(m) for m in modes):
        print(f"cpchat bench: --speculate: expected a comma list of {', '.join(SPECULATE)}", file=sys.stderr)
        return 2
    if args.link_delay_ms:
        os.environ[LINK_DELAY_ENV] = str(args.link_delay_ms)  # the ranks read it when they start
    model = bench_model(args)
    tokenizer = load_tokenizer(str(model))
    try:  # each mode as the ranks take it (a draft model resolved and checked)
        resolved = {m: resolve_speculation(m, tokenizer, str(model), whole_model=True) for m in modes}
    except BadInput as e:
        print(f"cpchat bench: {e}", file=sys.stderr)
        return 2
    questions = PROSE_QUESTIONS if args.model else DEMO_QUESTIONS
    started, rows = time.time(), []
    for n in args.ranks:
        cluster = Cluster.launch(n, blas_choice=args.blas_choice, pin_cpus=args.pin, threads=args.threads)
        try:
            cluster.connect()
            cluster.load(str(model))
            for context in args.contexts:
                document = sample_document(tokenizer, context)
                for kind, question in questions.items():
                    rows += compare_modes(cluster, tokenizer, document, question, kind, resolved, args)
                    for row in rows[-len(modes):]:
                        print(f"N={n} {context} {kind} {row.mode}: {row.median:.1f} tok/s, "
                              f"{row.accepted}/{row.proposed} taken", file=sys.stderr)
        finally:
            cluster.close()
    out = Path(args.out)
    lines = report_lines(rows, modes, command, model, args, time.time() - started)
    write_report(out, "speculation", lines, {"command": command, "model": str(model), "machine": machine(),
                                             "link_delay_ms": args.link_delay_ms,
                                             "rows": [asdict(r) for r in rows]})
    print(f"wrote {out / 'speculation.md'}", file=sys.stderr)
    return 0


def compare_modes(cluster: Cluster, tokenizer, document, question: str, kind: str, modes: dict[str, str],
                  args) -> list[SpeculationRow]:
    """Each mode's row for one prompt (`modes`: each as named, as the ranks take it): the first run
    prefills it, every later run its last token."""
    cluster.reset(0)
    session = Session(cluster, tokenizer, sampling=SamplingOptions(max_tokens=args.decode, temperature=0.0),
                      draft_tokens=args.draft_tokens)
    tokens = session.prepare(question, [document]).tokens
    rows = {m: SpeculationRow(len(tokens), cluster.size, kind, m) for m in modes}
    answers: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for mode in modes:
            session.speculate = modes[mode]
            answer, done = [], None
            for event in session.generate(tokens):
                if isinstance(event, Token):
                    answer.append(event.id)
                elif isinstance(event, Done):
                    done = event
            row = rows[mode]
            row.decode_tokens_per_s.append(done.decode_tokens_per_s)
            row.answer_tokens, row.decided = len(answer), len(answer) - 1 + (len(answer) < args.decode)
            row.steps = done.speculation.steps or row.decided
            row.proposed, row.accepted = done.speculation.proposed, done.speculation.accepted
            row.same_answer &= answers.setdefault("first", answer) == answer
    off = rows.get("off")
    ended = [tokenizer.eos_token_id] if len(answers["first"]) < args.decode else []
    for mode, row in rows.items():
        row.answer = answers["first"] + ended
        if off is not None and mode == "lookup" and row.proposed and off.median and row.median:
            plain_s, decode_s = 1 / off.median, (row.answer_tokens - 1) / row.median
            row.check_cost = max((decode_s / plain_s - row.steps) / row.proposed, 0.0)
            row.best = row.decided / best_steps(tokens, row.answer, row.check_cost)
    return list(rows.values())


def best_steps(prompt: list[int], answer: list[int], cost: float) -> float:
    """The least time, in plain steps, in which steps checking lookup proposals decide `answer` after its
    first token, where a step checking k proposals takes 1 + cost k: the draft lengths an oracle would
    choose, knowing the answer (a shortest path over the answer's positions)."""
    best = [0.0] + [float("inf")] * (len(answer) - 1)
    tokens = np.array(prompt + answer, np.uint32)
    for i in range(1, len(answer)):  # answer[:i] decided: the step's block begins with answer[i - 1]
        proposal = propose(tokens[:len(prompt) + i], MAX_DRAFT)
        ahead = answer[i:i + len(proposal)]
        agree = next((j for j, (p, a) in enumerate(zip(proposal, ahead, strict=False)) if p != a), len(ahead))
        for k in range(MAX_DRAFT + 1):
            reached = min(i + min(k, agree) + 1, len(answer))
            best[reached - 1] = min(best[reached - 1], best[i - 1] + 1 + cost * k)
    return best[-1]


def report_lines(rows: list[SpeculationRow], modes: list[str], command: str, model: Path, args,
                 seconds: float) -> list[str]:
    delay = f"; every message between ranks delayed {args.link_delay_ms} ms" if args.link_delay_ms else ""
    delay += f"; {args.draft_tokens} tokens proposed a step" if args.draft_tokens else ""
    lines = ["# cpchat bench --speculate", "", f"Command: `{command}`  ",
             f"Model: `{model.name}`; {args.repeats} repeat(s), the median; greedy answers of up to "
             f"{args.decode} tokens{delay}; {os.cpu_count()} cores; took {seconds:.0f} s.", "",
             "| context | ranks | answer | mode | decode tok/s | vs off | best lengths | check cost "
             "| tokens a step | proposed | accepted | answer tokens | same answer |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines[-2:-2] = ["`answer` names the question asked: one whose answer quotes the document, or one",
                    "whose answer need not (the demo model may still quote a fact it should not). Tokens a",
                    "step: those the decode steps decided (the answer's after its first, and the end of",
                    "sequence) over the steps. Check cost: what each proposal checked added to a plain step,",
                    "as a share of it (from this row's time and steps and off's). Best lengths: the speed-up",
                    "if every step had proposed the number of tokens that pays best, knowing the answer (the",
                    "same proposals, the same check cost): what no choice of draft lengths can beat.", ""]
    off = {(r.context, r.ranks, r.question): r.median for r in rows if r.mode == "off"}
    for r in rows:
        base = off.get((r.context, r.ranks, r.question))
        ratio = f"{r.median / base:.2f}×" if base and r.mode != "off" else ""
        per_step = r.decided / r.steps if r.steps else 0.0
        best = f"{r.best:.2f}×" if r.best is not None else ""
        cost = f"{r.check_cost:.2f}" if r.check_cost is not None else ""
        lines.append(f"| {r.context:,} | {r.ranks} | {r.question} | {r.mode} | {r.median:.1f} | {ratio} "
                     f"| {best} | {cost} "
                     f"| {per_step:.2f} | {r.proposed} | {r.accepted} | {r.answer_tokens} "
                     f"| {'yes' if r.same_answer else 'NO'} |")
    return lines
