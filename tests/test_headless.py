"""The headless CLI contract of docs/design.md §1, through the real `cpchat` command."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import DEMO_MODEL
from helpers import CPCHAT, events, one_line_error, rank_processes, run
from makedocs import write_pdf
from rankprocs import wait_gone
from references import reference_generate, reference_tokenizer

import cpchat
from cpchat import blas
from cpchat.core.sharding import rank_tokens

SAMPLE_DOC = Path(__file__).resolve().parents[1] / "assets" / "sample-doc.txt"


@pytest.mark.slow
def test_json_events_match_mlx_lm(model_dir):
    path = model_dir("llama")
    # It starts with an existing file's path: a headless prompt goes as written, nothing attached
    prompt = f"{path / 'config.json'} The quick brown fox jumps over the lazy dog."
    args = f"--headless --json --raw --temp 0 --max-tokens 6 --model {path} --ranks 2 --shares 1,2".split()
    result = run(args + ["--prompt", prompt])
    assert result.returncode == 0, result.stderr
    evs = events(result.stdout)
    names = [e["event"] for e in evs]
    steps = names.count("progress")  # at least the one at the end of the prefill
    tokens = len(evs) - 3 - steps
    assert steps >= 1
    assert names == ["ready"] + ["progress"] * steps + ["prefill"] + ["token"] * tokens + ["done"]
    ready, prefill, done = evs[0], evs[1 + steps], evs[-1]
    assert [r["rank"] for r in ready["ranks"]] == [0, 1] and ready["version"] == cpchat.__version__
    assert all(r["address"].startswith("127.0.0.1:") for r in ready["ranks"])
    assert ready["transport"] == "shm"  # local ranks share memory
    assert [r["threads"] for r in ready["ranks"]] == [blas.shared_threads(2)] * 2  # the cores shared out
    assert ready["shares"] == "1,2" and all(r["speed"] > 0 for r in ready["ranks"])
    tokenizer = reference_tokenizer(path)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert prefill["turn"] == 0 and prefill["new_tokens"] == len(ids) and prefill["cached_tokens"] == 0
    assert prefill["shares"] == rank_tokens(len(ids), 2, (1, 2))  # the tokens each rank took
    assert prefill["shares"][1] > prefill["shares"][0]
    # auto runs the least estimated algorithm (at N = 2 pass-KV's hop and all-gather's exchange move the
    # same bytes, so the measured latencies decide between them)
    estimates = prefill["estimates_ms"]
    assert estimates[prefill["algorithm"]] == min(estimates.values()) and prefill["ms"] > 0
    expected = reference_generate(path, ids, 6)
    tokens = [e for e in evs if e["event"] == "token"]
    assert [t["id"] for t in tokens] == [t for t, _ in expected]
    assert all(abs(t["logprob"] - lp) <= 1e-3 for t, (_, lp) in zip(tokens, expected, strict=True))
    assert done["prompt_tokens"] == len(ids) and done["generated_tokens"] == len(tokens)
    assert done["ttft_ms"] > 0 and [r["rank"] for r in done["ranks"]] == [0, 1]
    assert sum(r["kv_tokens"] for r in done["ranks"]) == len(ids) + len(tokens) - 1
    assert all(r["kv_bytes"] > 0 and r["rss_bytes"] > 0 for r in done["ranks"])
    assert done["speculation"]["mode"] == "lookup"  # the default: auto


@pytest.mark.slow
def test_speculation_says_what_it_did_and_changes_no_answer(model_dir):
    """The demo model quotes the sample document: with lookup proposals (the default), or the demo model
    as its own draft (a relative path), the answer is the one made a token a step, in fewer steps; `done`
    says how many tokens were proposed and taken. Values the flags do not take, a draft model that is
    not there and one of another tokenizer are refused in one line."""
    base = ["--headless", "--json", "--ranks", "2", "--model", str(DEMO_MODEL), "--doc", str(SAMPLE_DOC),
            "--prompt", "What is the access code for the Orion vault?"]
    draft = f"draft:{os.path.relpath(DEMO_MODEL)}"
    runs = {mode: events(run(base + ["--speculate", mode]).stdout) for mode in ("off", "lookup", draft)}
    texts = {mode: "".join(e["text"] for e in evs if e["event"] == "token") for mode, evs in runs.items()}
    assert set(texts.values()) == {"The access code for the Orion vault is 4812-KX."}
    off, lookup, drafted = (next(e for e in runs[m] if e["event"] == "done")["speculation"]
                            for m in ("off", "lookup", draft))
    assert off == {"mode": "off", "proposed": 0, "accepted": 0, "steps": 0}
    assert lookup["mode"] == "lookup" and lookup["proposed"] >= lookup["accepted"] > 0
    assert drafted["mode"] == "draft" and drafted["proposed"] >= drafted["accepted"] > 0
    generated = next(e for e in runs["lookup"] if e["event"] == "done")["generated_tokens"]
    assert lookup["steps"] < generated - 1 and drafted["steps"] < generated - 1
    for flags, words in ((["--speculate", "draft:"], "is not off, lookup, auto, draft:MODEL"),
                         (["--speculate", "draft:tiny"], "draft model: model path tiny does not exist"),
                         (["--speculate", f"draft:{model_dir('llama')}"], "has another tokenizer than"),
                         (["--draft-tokens", "99"], "is not 1 to 16")):
        one_line_error(run(base + flags), 2, words)


@pytest.mark.slow
def test_plain_output_and_stdin_turns_share_one_conversation(model_dir):
    """Three raw stdin turns equal one single-process run over the whole history."""
    path = model_dir("qwen2")
    turns = ["first turn text", "second one", "and the third"]
    args = f"--headless --json --raw --temp 0 --max-tokens 4 --model {path} --ranks 3 --algorithm pass_q"
    result = run(args.split(), stdin="\n".join(turns) + "\n")
    assert result.returncode == 0, result.stderr
    evs = events(result.stdout)
    tokenizer = reference_tokenizer(path)
    history: list[int] = []
    for turn, text in enumerate(turns):
        history += tokenizer.encode(text, add_special_tokens=False)
        got = [e["id"] for e in evs if e["event"] == "token" and e["turn"] == turn]
        assert got == [t for t, _ in reference_generate(path, history, 4)]
        prefill = next(e for e in evs if e["event"] == "prefill" and e["turn"] == turn)
        assert prefill["cached_tokens"] == (0 if turn == 0 else len(history) - prefill["new_tokens"])
        history += got

    args = f"--headless --raw --temp 0 --max-tokens 4 --model {path} --ranks 1".split()
    plain = run(args + ["--prompt", turns[0]])
    first = [e for e in evs if e["event"] == "token" and e["turn"] == 0]
    assert plain.returncode == 0
    assert plain.stdout == "".join(e["text"] for e in first) + "\n"


@pytest.mark.slow
def test_documents_reach_the_prompt(model_dir, tmp_path):
    path = model_dir("llama")
    doc = tmp_path / "notes.txt"
    doc.write_text("The access code for the Orion vault is 4812-KX.\n" * 20)
    line = json.dumps({"content": "What is the code?", "docs": [str(doc)]})
    result = run(
        ["--headless", "--json", "--max-tokens", "2", "--model", str(path), "--ranks", "2"],
        stdin=line + "\nthanks\n",
    )
    assert result.returncode == 0, result.stderr
    prefills = [e for e in events(result.stdout) if e["event"] == "prefill"]
    tokenizer = reference_tokenizer(path)
    assert prefills[0]["new_tokens"] > len(tokenizer.encode(doc.read_text()))
    assert prefills[1]["cached_tokens"] > prefills[0]["new_tokens"] - 1


def filler(count: int) -> list[str]:
    """Paragraphs of the sample document that state no fact."""
    paragraphs = SAMPLE_DOC.read_text().split("\n\n")
    return [p for p in paragraphs if "code" not in p and "number" not in p][:count]


@pytest.mark.slow
def test_demo_model_answers_from_a_pdf_page_and_a_folder_file(tmp_path):
    """The shipped model, through 2 ranks: a fact on page 2 of a PDF, and one in a file of a dropped
    folder whose .gitignore hides a decoy with another value."""
    parts = filler(8)
    fact = "The access code for the Cedar mill is 7712-MR."
    pdf = write_pdf(tmp_path / "mill.pdf", [parts[0], f"{parts[1]} {fact}", parts[2]])
    root = tmp_path / "project"
    (root / "notes").mkdir(parents=True)
    (root / "old").mkdir()
    (root / ".gitignore").write_text("old/\n")
    (root / "README.md").write_text(parts[5] + "\n")
    (root / "notes" / "monday.txt").write_text(parts[6] + "\n")
    serial = "The serial number for the Basalt depot is"
    (root / "notes" / "tuesday.txt").write_text(f"{parts[7]} {serial} 55120.\n")
    (root / "old" / "draft.txt").write_text(f"{serial} 99999.\n")
    asks = [(pdf, "What is the access code for the Cedar mill?", "7712-MR"),
            (root, "What is the serial number for the Basalt depot?", "55120")]
    for doc, question, value in asks:
        result = run(["--headless", "--ranks", "2", "--doc", str(doc), "--prompt", question])
        assert result.returncode == 0, result.stderr
        assert value in result.stdout and "99999" not in result.stdout, (doc.name, result.stdout)


@pytest.mark.slow
def test_prefill_progress_events_and_plain_progress_on_stderr(tmp_path):
    """A long prompt through 2 ranks reports its prefill: JSON `progress` events at most 4 a second,
    ending with every new token processed; plain mode says it on stderr only with --progress."""
    doc = tmp_path / "long.txt"
    doc.write_text("\n\n".join(filler(40) * 3))
    base = ["--headless", "--ranks", "2", "--max-tokens", "2"]
    question = "What is the access code for the Orion vault?"
    result = run(base + ["--json", "--doc", str(doc), "--prompt", question])
    assert result.returncode == 0, result.stderr
    evs = events(result.stdout)
    progress = [e for e in evs if e["event"] == "progress"]
    prefill = next(e for e in evs if e["event"] == "prefill")
    done = next(e for e in evs if e["event"] == "done")
    assert progress and evs.index(progress[-1]) < evs.index(prefill)
    assert {e["total"] for e in progress} == {done["prompt_tokens"]}
    assert {e["cached"] for e in progress} == {prefill["cached_tokens"]}
    assert progress[-1]["processed"] == prefill["new_tokens"] > 5_000
    steps = [e["processed"] for e in progress]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    gaps = [b["ms"] - a["ms"] for a, b in zip(progress[:-2], progress[1:-1], strict=True)]
    assert all(gap >= 250 for gap in gaps), gaps  # a few a second; only the last comes sooner
    for flags, shown in ((["--progress"], True), ([], False)):  # the last line comes for any prefill
        result = run(base + flags + ["--prompt", question])
        assert result.returncode == 0, result.stderr
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith("cpchat: prefill ")]
        assert bool(lines) == shown and "prefill" not in result.stdout
        if shown:
            assert re.fullmatch(r"cpchat: prefill ([\d,]+)/\1 new tokens \(100 %\), [\d.]+ s", lines[-1])


@pytest.mark.slow
def test_a_prompt_past_the_context_exits_2_with_both_numbers(tmp_path):
    from cpchat.smallmodels import write_model

    model = write_model(tmp_path / "short", "llama", max_position_embeddings=96)
    doc = tmp_path / "long.txt"
    doc.write_text("word " * 100)
    result = run(["--headless", "--model", str(model), "--doc", str(doc), "--prompt", "What?"], timeout=60)
    one_line_error(result, 2, "the model's 96-token context")
    assert re.search(r"the prompt is [\d,]+ tokens", result.stderr), result.stderr


def test_version_comes_from_one_place():
    result = subprocess.run(CPCHAT + ["--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == f"cpchat {cpchat.__version__}\n"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "cpchat.__version__"' in pyproject


def test_the_wheel_lists_every_package():
    """A package missing from pyproject's list is missing from the wheel (the TUI's screens once were)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "cpchat").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_the_demo_model_is_described_by_its_model_card():
    from cpchat.client.settings import demo_model

    path, description = demo_model()
    first = " ".join((path / "README.md").read_text().split("\n\n")[1].split()).split(". ")[0]
    assert description.startswith("the built-in demo model, " + first[0].lower() + first[1:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
        (["--prompt-file", "/nonexistent/q.txt"], "prompt file /nonexistent/q.txt does not exist"),
        (
            ["--prompt", "hi", "--doc", "/nonexistent/book.txt"],
            "document /nonexistent/book.txt does not exist",
        ),
        (["--prompt", "   "], "empty"),
        (["--prompt", "hi", "--attach", "nocolon"], "bad rank address"),
        (["--prompt", "hi", "--ranks", "0"], "ranks"),
        (["--prompt", "hi", "--shares", "1,fast"], "shares from flag --shares: '1,fast' is not auto, equal"),
        (["--prompt", "hi", "--ranks", "2", "--shares", "1,2,3"], "--shares 1,2,3 gives 3 weights for 2"),
    ],
)
def test_bad_input_exits_2_with_one_line(model_dir, args, words):
    if "--model" not in args:
        args = args + ["--model", str(model_dir("llama"))]
    one_line_error(run(["--headless"] + args, timeout=60), 2, words)


@pytest.mark.slow
def test_unreachable_rank_exits_3(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run(
        ["--headless", "--model", str(model_dir("llama")), "--prompt", "hi", "--attach", f"127.0.0.1:{port}"],
        timeout=60,
    )
    one_line_error(result, 3, f"rank 0 (127.0.0.1:{port}) is unreachable")


@pytest.mark.slow
def test_unsupported_architecture_is_refused(tmp_path):
    """A model of Mamba-2 layers only (no attention layer) loads in mlx-lm but not in cpchat, which runs
    hybrids: it is refused, saying why."""
    from cpchat.smallmodels import write_model

    path = write_model(tmp_path / "mamba", "nemotron_h", overrides={"hybrid_override_pattern": ["M", "-"]})
    result = run(["--headless", "--model", str(path), "--prompt", "hi", "--ranks", "2"], timeout=90)
    one_line_error(result, 2, "nemotron_h: no layer attends over keys and values")
    assert "not supported for context parallelism" in result.stderr


def test_rank_refuses_public_bind_without_token_and_taken_port():
    result = subprocess.run(
        CPCHAT + ["rank", "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--token-file" in result.stderr and "Traceback" not in result.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = subprocess.run(
            CPCHAT + ["rank", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


SIGINT_DEFAULT_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable, '-m', 'cpchat', *sys.argv[1:]])")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_ranks_never_outlive_the_front_end(model_dir, sig):
    p = subprocess.Popen(
        # As from a terminal: a runner started in the background (`cmd &`) ignores SIGINT, children
        # too, so the front end starts with it back to the default. Not with preexec_fn: that forks
        # this process, which holds gRPC channels, and grpcio >= 1.80 can abort such a fork child
        # with "epoll_wait error: Bad file descriptor" (grpc/grpc#43055).
        [sys.executable, "-c", SIGINT_DEFAULT_EXEC, "--headless", "--json", "--model",
         str(model_dir("llama")), "--ranks", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()  # the front end then waits for a turn on stdin
        assert line, f"front end exited {p.wait()} before ready: {p.stderr.read()}"
        assert json.loads(line)["event"] == "ready"
        assert len(rank_processes(p.pid)) == 2
        os.kill(p.pid, sig)
        p.wait(timeout=30)
        assert wait_gone(lambda: rank_processes(p.pid)) == []
        if sig != signal.SIGKILL:
            assert "Traceback" not in p.stderr.read()
    finally:
        p.kill()
        p.wait()


def test_rank_refuses_bad_tokens_and_second_generation(clusters, model_dir):
    from cpchat.protocol import cpchat_pb2 as pb

    path = model_dir("llama")
    cluster = clusters.get(2, path)
    rank0 = cluster.ranks[0].control
    with pytest.raises(grpc.RpcError) as err:
        list(rank0.Generate(pb.GenerateRequest(request_id="bad", tokens=[1, 10**6], max_tokens=1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(rank0.Generate(pb.GenerateRequest(request_id="bad", tokens=[1], max_tokens=1, shares=[1, 2, 3])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 ranks need 2 positive shares, got [1, 2, 3]" in err.value.details()
    # Rank 0 alone waits for rank 1's blocks: it stays busy until cancelled.
    stream = rank0.Generate(pb.GenerateRequest(request_id="solo", tokens=[5] * 50, max_tokens=5))
    deadline = time.monotonic() + 30
    while rank0.Health(pb.HealthRequest()).state != "busy":
        assert time.monotonic() < deadline, "rank 0 never started the request"
    with pytest.raises(grpc.RpcError) as err:
        list(rank0.Generate(pb.GenerateRequest(request_id="second", tokens=[5], max_tokens=1)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "busy" in err.value.details()
    assert rank0.Cancel(pb.CancelRequest(request_id="solo")).cancelled
    assert [e.WhichOneof("event") for e in stream][-1] == "done"
    tokens = [e.id for e in cluster_tokens(cluster, [5, 6, 7])]
    assert len(tokens) == 3


def test_stats_stream_reports_the_end_of_a_request_at_once(clusters, model_dir):
    """The ranks panel must not say "busy" after the answer: a Stats stream that checks its
    figures only every 10 s still sends the state change to "ready" as it happens."""
    from cpchat.protocol import cpchat_pb2 as pb

    cluster = clusters.get(2, model_dir("llama"))
    stream = cluster.ranks[0].control.Stats(pb.StatsRequest(interval_s=10), timeout=5,
                                            metadata=cluster.metadata)
    first = next(stream)
    assert first.state == "ready"
    assert len(cluster_tokens(cluster, [5, 6, 7])) == 3
    # Within the 5 s deadline, long before the next 10 s check: the request's "busy", then "ready".
    after = next(s for s in stream if s.state == "ready")
    assert after.kv_tokens > first.kv_tokens
    stream.cancel()


def cluster_tokens(cluster, ids):
    from cpchat.client.generation import GenerationRequest, TokenOut

    return [e for e in cluster.generate(GenerationRequest(ids, max_tokens=3)) if isinstance(e, TokenOut)]


def test_rank_that_fails_to_start_exits_3(model_dir, tmp_path):
    """A rank that cannot even import (here: psutil, broken for rank processes only) is named."""
    (tmp_path / "psutil.py").write_text(
        "import os, sys\n"
        "if sys.argv[1:2] == ['rank']:\n"
        "    raise ImportError('psutil is broken on purpose')\n"
        "sys.path = [p for p in sys.path if os.path.abspath(p or '.') != os.path.dirname(__file__)]\n"
        "del sys.modules['psutil']\n"
        "import psutil\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = subprocess.run(
        CPCHAT + ["--headless", "--model", str(model_dir("llama")), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    one_line_error(
        subprocess.CompletedProcess(p.args, p.returncode, p.stdout, p.stderr),
        3,
        "local rank 0 failed to start: ImportError: psutil is broken on purpose",
    )
