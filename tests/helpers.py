"""Helpers shared by the integration tests."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import psutil
from rankprocs import ranks_started_with, wait_gone
from references import reference_tokenizer, tie_scores

from cpchat.client.events import Done, Prefill, Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.demo.data import make_example
from cpchat.families import ARCHITECTURES, LLAMA3_ROPE_SCALING

CPCHAT = [sys.executable, "-m", "cpchat"]
ALGORITHMS = ("pass_kv", "pass_q", "all_gather", "ulysses", "auto")
VARIANTS = {  # name -> (model type, options): the forms a family takes in published checkpoints
    **{arch: (arch, {}) for arch in ARCHITECTURES},
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
    "ministral3-sliding": ("ministral3", {"sliding_window": 8}),
}


def random_prompt(path: Path, length: int, seed: int) -> list[int]:
    tokenizer = reference_tokenizer(path)
    vocab = len(tokenizer.vocab)
    rng = random.Random(seed)
    stop = set(tokenizer.eos_token_ids)
    return [t for t in (rng.randrange(3, vocab) for _ in range(length * 2)) if t not in stop][:length]


def raw_session(cluster, path: Path, algorithm: str, max_tokens: int, shares: str = "auto") -> Session:
    """A greedy session that sends token ids as they are (no chat template)."""
    return Session(cluster, load_tokenizer(str(path)), raw=True, algorithm=algorithm,
                   sampling=SamplingOptions(max_tokens=max_tokens, temperature=0.0), shares=shares)


def next_turn(session: Session, new: list[int]) -> tuple[list[tuple[int, float]], list]:
    """One raw turn, the conversation so far plus `new`: (tokens with logprobs, events)."""
    events = list(session.generate(session.raw_history + new))
    return [(e.id, e.logprob) for e in events if isinstance(e, Token)], events


def run_raw(cluster, path: Path, ids: list[int], algorithm: str, max_tokens: int, shares: str = "auto"):
    """Generate through real ranks from token ids; returns (tokens, events, session)."""
    session = raw_session(cluster, path, algorithm, max_tokens, shares)
    tokens, events = next_turn(session, ids)
    return tokens, events, session


def prefill_event(events) -> Prefill:
    return next(e for e in events if isinstance(e, Prefill))


def done_event(events) -> Done:
    return next(e for e in events if isinstance(e, Done))



def assert_as_mlx_lm_up_to_a_tie(path: Path, ids: list[int], got: list[tuple[int, float]],
                                  expected: list[tuple[int, float]], noise: float) -> int:
    """cpchat's greedy steps are mlx-lm's, logprobs within 1.5x its low-precision noise `noise`, all of them
    or those before a step where the two picks are a tie at the checkpoint's precision: mlx-lm's own
    forward scores them within 1.5x its noise of each other, and the same weights run in float32 rank
    cpchat's pick no lower than mlx-lm's. At the tie, cpchat's logprob of its pick is held to mlx-lm's
    score of that token. Any other difference fails. Returns the steps before the tie. (A random model's
    flat logits meet such ties: cpchat's decode multiplies in float32, mlx-lm's in its low-precision
    kernels.)"""
    ours, theirs = [t for t, _ in got], [t for t, _ in expected]
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    agree = len(ours) if step is None else step
    pairs = zip(got[:agree], expected[:agree], strict=True)
    worst = max((abs(a - b) for (_, a), (_, b) in pairs), default=0.0)
    assert worst <= 1.5 * noise, f"logprobs off by {worst:.4f}; mlx-lm's own noise is {noise:.4f}"
    if step is None:
        assert len(ours) == len(theirs), f"{len(ours)} tokens, mlx-lm {len(theirs)}"
        return agree
    (mine, its), (mine_32, its_32) = tie_scores(path, ids + theirs[:step], [ours[step], theirs[step]])
    assert abs(mine - its) <= 1.5 * noise and mine_32 >= its_32, (
        f"step {step}: cpchat picked {ours[step]}, mlx-lm {theirs[step]}; mlx-lm scores them {mine:.4f} and "
        f"{its:.4f} (noise {noise:.4f}), in float32 {mine_32:.4f} and {its_32:.4f}")
    assert abs(got[step][1] - mine) <= 1.5 * noise, (
        f"step {step}: cpchat's logprob of its pick is {got[step][1]:.4f}, mlx-lm's {mine:.4f}")
    if step == 0:
        warnings.warn("a tie at the first step: only its logprob was compared with mlx-lm's", stacklevel=2)
    return step


def assert_same(got, expected):
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert abs(a - b) <= 1e-3


def question_ids(path, seed: int, n_questions: int = 1) -> tuple[list[int], list[str]]:
    """A demo document with a question, as chat-template token ids, and the later questions."""
    example = make_example(random.Random(seed), 30, n_questions=n_questions)
    tokenizer = reference_tokenizer(path)
    first = example.messages()[0]
    ids = tokenizer.apply_chat_template([first], add_generation_prompt=True)
    return ids, [q for q, _ in example.turns[1:]]


# ---- the `cpchat` command, as a user runs it


def rank_holds(limit: int, model: Path | None = None, ranks: int = 1) -> int:
    """What a rank launched under CPCHAT_MEMORY_LIMIT=`limit` (the caller sets it) holds, idle or with
    `model` loaded: the limit less the memory it reports free (the least of `ranks`)."""
    from cpchat.client.cluster import Cluster

    cluster = Cluster.launch(ranks)
    try:
        cluster.connect()
        if model is not None:
            cluster.load(str(model))
        return limit - min(cluster.free_memory())
    finally:
        cluster.close()


def rank_processes(parent_pid: int) -> list[psutil.Process]:
    return ranks_started_with("--parent-pid", lambda value: value == str(parent_pid))


def run(args: list[str], stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    p = subprocess.Popen(
        CPCHAT + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = p.communicate(stdin, timeout=timeout)
    assert wait_gone(lambda: rank_processes(p.pid)) == [], "rank processes outlived the front end"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def one_line_error(result: subprocess.CompletedProcess, code: int, words: str) -> None:
    assert result.returncode == code, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("cpchat"), result.stderr
    assert words in lines[0]
    assert "Traceback" not in result.stderr


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


class Asked:
    """A request as `cpchat serve`'s scheduler runs it (the server's is bound to its event loop): what
    it was told, as it was told it."""

    def __init__(self, tokens: list[int], max_tokens: int, log: list | None = None) -> None:
        self.tokens, self.max_tokens = tokens, max_tokens
        self.log = log  # (request, event) of every request that shares it, in the order they came
        self.cancelled, self.admitted, self.ended = threading.Event(), threading.Event(), threading.Event()
        self.refusal: BaseException | None = None
        self.tokens_out: list[int] = []
        self.changed = threading.Condition()

    def prepare(self, session) -> None:
        session.sampling = SamplingOptions(self.max_tokens, temperature=0.0, ignore_eos=True)

    def admit(self, error: BaseException | None = None) -> None:
        if not self.admitted.is_set():
            self.refusal = error
            self.admitted.set()

    def put(self, item) -> None:
        if self.log is not None:
            self.log.append((self, item))
        with self.changed:
            if isinstance(item, Token):
                self.tokens_out.append(item.id)
            self.changed.notify_all()

    def end(self) -> None:
        self.ended.set()

    def wait_for_tokens(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.tokens_out) >= count, timeout=120), self.tokens_out
