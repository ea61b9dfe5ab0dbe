"""Evaluate the demo model: exact-match accuracy by context length and fact position.

    python -m cpchat.demo.evaluate --model assets/demo-model --lengths 1024,2048,4096 --n 20
    python -m cpchat.demo.evaluate --ranks 1,4 ...   # the same, through cpchat's ring

The generation function is pluggable (`evaluate(generate_fn, ...)`): mlx-lm in
this process, or cpchat's client driving N context-parallel rank processes.
With several rank counts the examples are the same for each, and the answers
are compared one by one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cpchat.demo.data import NOT_FOUND, make_example, render_user_turn
from cpchat.demo.prose_examples import answered_value, make_prose_example

# generate_fn(doc_name, doc_text, question) -> the answer text
GenerateFn = Callable[[str, str, str], str]
POSITION_CELLS = ("start", "middle", "end", "absent")
# measured with the demo tokenizers (train.py prints them); documents are sized by them
TOKENS_PER_SENTENCE = 10.7  # synthetic grammar sentences
CHARS_PER_TOKEN = 3.55  # real prose
DATA = ("prose", "synthetic")


def mlx_generate_fn(model_path: str | Path, max_tokens: int = 48) -> GenerateFn:
    """Single-process mlx-lm generation with greedy decoding."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_path))
    sampler = make_sampler(temp=0.0)

    def fn(doc_name: str, doc_text: str, question: str) -> str:
        messages = [{"role": "user", "content": render_user_turn(doc_name, doc_text, question)}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler, verbose=False)

    return fn


def ring_generate_fn(model_path: str | Path, ranks: int, max_tokens: int = 48) -> tuple[GenerateFn, Callable]:
    """Greedy generation through `ranks` local rank processes; returns (fn, close)."""
    from cpchat.client.cluster import Cluster
    from cpchat.client.events import Token
    from cpchat.client.session import SamplingOptions, Session, load_tokenizer

    cluster = Cluster.launch(ranks)
    try:
        cluster.connect()
        cluster.load(str(model_path))
    except BaseException:
        cluster.close()
        raise
    session = Session(cluster, load_tokenizer(str(model_path)), sampling=SamplingOptions(max_tokens, 0.0))

    def fn(doc_name: str, doc_text: str, question: str) -> str:
        session.reset()
        events = session.send(render_user_turn(doc_name, doc_text, question))
        return "".join(e.text for e in events if isinstance(e, Token))

    return fn, cluster.close


def answer_questions(model_path: str | Path, doc_name: str, doc_text: str, questions: Sequence[str],
                     max_tokens: int = 48) -> list[str]:
    """Greedy answers (mlx-lm, one process) to several questions about one document.

    The document is prefilled once and its KV cache copied for each question,
    which keeps the shipped-model test fast.
    """
    import copy

    import mlx.core as mx
    from mlx_lm import generate, load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_path))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": render_user_turn(doc_name, doc_text, q)}],
                                      add_generation_prompt=True)
        for q in questions
    ]
    common = 0
    while all(len(p) > common + 1 and p[common] == prompts[0][common] for p in prompts):
        common += 1
    base = make_prompt_cache(model)
    mx.eval(model(mx.array([prompts[0][:common]]), cache=base))
    sampler = make_sampler(temp=0.0)
    return [
        generate(model, tokenizer, p[common:], max_tokens=max_tokens, sampler=sampler, verbose=False,
                 prompt_cache=copy.deepcopy(base)).strip()
        for p in prompts
    ]


def evaluate(
    generate_fn: GenerateFn,
    lengths: Sequence[int],
    positions: Sequence[str] = POSITION_CELLS,
    n_per_cell: int = 20,
    seed: int = 1234,
    data: str = "prose",
    log: Callable[[str], None] | None = None,
    score: str = "exact",
) -> list[dict]:
    """Run held-out examples; one row per (length, position) with n, correct and accuracy.

    `lengths` are approximate prompt lengths in tokens. Position "absent"
    asks about a fact the document does not hold (answer: NOT_FOUND).
    Held-out: the seed differs from training's, and every cell has its own stream.
    `data` "prose": the held-out prose pool and names never seen in training,
    scored on the answered value; "synthetic": the grammar documents training
    also used, scored on the whole answer sentence. `score` "contains" is for models that answer in
    their own words (`holds_value`).
    """
    rows = []
    for length in lengths:
        for position in positions:
            rng = random.Random(f"{seed}-{length}-{position}")
            n_filler = max(1, round(length / TOKENS_PER_SENTENCE) - 8)
            n_chars = max(40, round((length - 120) * CHARS_PER_TOKEN))
            correct = 0
            answers = []
            t0 = time.time()
            for _ in range(n_per_cell):
                absent = position == "absent"
                where, p_absent = (None, 1.0) if absent else (position, 0.0)
                if data == "prose":
                    ex = make_prose_example(rng, "heldout", n_chars, position=where, p_absent=p_absent)
                else:
                    ex = make_example(rng, n_filler, position=where, p_absent=p_absent)
                question, answer = ex.turns[0]
                got = generate_fn(ex.doc_name, ex.doc_text, question).strip()
                answers.append(got)
                if score == "contains":
                    right = holds_value(got, answer, ex)
                elif data == "prose":
                    right = answered_value(got) == answered_value(answer)
                else:
                    right = got == answer
                correct += right
                if log and not right:
                    log(f"  miss len={length} pos={position}: want {answer!r} got {got!r}")
            row = {"length": length, "position": position, "n": n_per_cell, "correct": correct,
                   "accuracy": correct / n_per_cell, "seconds": round(time.time() - t0, 1)}
            if log:
                log(json.dumps(row))
            rows.append(row | {"answers": answers})
    return rows


def holds_value(got: str, answer: str, example) -> bool:
    """A looser score for a general chat model: the answer contains the asked value; for an absent fact,
    it gives none of the document's values and says no (a negation), rather than inventing one."""
    value = answered_value(answer)
    lowered = got.lower()
    if value != NOT_FOUND:
        return value is not None and value.lower() in lowered
    gives_a_value = any(fact.value.lower() in lowered for fact in example.facts)
    return not gives_a_value and any(word in f" {lowered}" for word in (" not ", "n't", " no ", "cannot"))


def format_table(rows: list[dict]) -> str:
    """Markdown table: one line per length, one column per position, plus the overall accuracy."""
    positions = list(dict.fromkeys(r["position"] for r in rows))
    lines = ["| context (tokens) | " + " | ".join(positions) + " | all |",
             "|---:|" + "---:|" * (len(positions) + 1)]
    for length in dict.fromkeys(r["length"] for r in rows):
        cells = {r["position"]: r for r in rows if r["length"] == length}
        n = sum(c["n"] for c in cells.values())
        ok = sum(c["correct"] for c in cells.values())
        lines.append(f"| {length} | " + " | ".join(
            f"{cells[p]['correct']}/{cells[p]['n']}" if p in cells else "" for p in positions
        ) + f" | {100 * ok / n:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/demo-model")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--positions", default=",".join(POSITION_CELLS))
    ap.add_argument("--n", type=int, default=20, help="examples per (length, position) cell")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", choices=DATA, default="prose",
                    help="held-out prose and names (scored on the value), or the synthetic documents")
    ap.add_argument("--score", choices=("exact", "contains"), default="exact",
                    help="exact: the demo model's answer form; contains: the value anywhere in the answer "
                         "(a general chat model)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--ranks", help="comma-separated rank counts: answer through cpchat's ring, not mlx-lm")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--ask-doc", type=Path, help="instead: answer --question(s) about this file, print JSON")
    ap.add_argument("--question", action="append", default=[])
    args = ap.parse_args(argv)
    # mlx-lm in this process would otherwise multiply with the wheel's reference BLAS (~30x slower)
    from cpchat.blas import rerun_preloaded
    from cpchat.client.launcher import rank_environment

    argv = sys.argv[1:] if argv is None else argv
    rerun_preloaded(["-m", "cpchat.demo.evaluate", *argv], rank_environment())
    if args.ask_doc:
        doc = args.ask_doc
        print(json.dumps(answer_questions(args.model, doc.name, doc.read_text(), args.question)))
        return
    lengths, positions = [int(x) for x in args.lengths.split(",")], args.positions.split(",")
    log = (lambda s: print(s, flush=True)) if args.verbose else None
    tables: dict[str, list[dict]] = {}
    for ranks in args.ranks.split(",") if args.ranks else [None]:
        if ranks is None:
            label, fn, close = "mlx-lm", mlx_generate_fn(args.model), None
        else:
            label = f"{ranks} rank" + "s" * (ranks != "1")
            fn, close = ring_generate_fn(args.model, int(ranks))
        try:
            tables[label] = evaluate(fn, lengths, positions, args.n, args.seed, args.data, log=log,
                                     score=args.score)
        finally:
            if close:
                close()
        print(f"### {label}\n\n{format_table(tables[label])}\n", flush=True)
    if len(tables) > 1:
        answers = [[a for row in rows for a in row["answers"]] for rows in tables.values()]
        same = sum(len(set(group)) == 1 for group in zip(*answers))
        print(f"identical answers across {', '.join(tables)}: {same}/{len(answers[0])}")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=2))


if __name__ == "__main__":
    main()

__all__ = ["NOT_FOUND", "GenerateFn", "answer_questions", "evaluate", "format_table", "mlx_generate_fn"]
