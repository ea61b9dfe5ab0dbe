"""`cpchat serve` through real clients: the official `openai` package and curl against a real server
on 2 real ranks (one server for the module), its answers compared with headless's."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from conftest import DEMO_MODEL
from helpers import random_prompt
from prometheus_client.parser import text_string_to_metric_families
from rankprocs import ranks_started_with, wait_gone
from references import MlxReference, reference_generate, reference_tokenizer

from cpchat.client.events import Token
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.prompt import user_message
from cpchat.serve.generation import StopText
from cpchat.serve.openai_api import ApiError, GenerationParams, parse_chat

KEY = "test-key-0123"
BATCH = 2  # answers decoding together
QUEUE = 4
MAX_BODY = 2_000_000
SAMPLE_DOC = Path(__file__).resolve().parents[1] / "assets" / "sample-doc.txt"
DEFAULTS = GenerationParams(max_tokens=16, temperature=0.0, top_p=1.0)
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def http(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """A plain request (what a client that is not openai's sends): status and JSON body."""
    request = urllib.request.Request(url, data=body, headers=AUTH, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Server:
    def __init__(self, process: subprocess.Popen, url: str, lines: list[str]) -> None:
        self.process, self.url, self.lines = process, url, lines

    def client(self, key: str | None = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kwargs)

    def health(self) -> dict:
        return http(self.url + "/health")[1]

    def until(self, condition, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while not condition(health := self.health()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {health}"
            time.sleep(0.05)
        return health


def start_server(args: list[str], env: dict | None = None) -> Server:
    process = subprocess.Popen([sys.executable, "-m", "cpchat", "serve", "--port", "0", *args],
                               stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    for line in process.stderr:
        lines.append(line)
        if found := re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line):
            break
    else:
        raise AssertionError(f"cpchat serve did not start: {''.join(lines)}")
    threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True).start()
    return Server(process, found.group(1), lines)


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="module")
def server(model):
    s = start_server(["--model", str(model), "--ranks", "2", "--api-key", KEY, "--max-queue", str(QUEUE),
                      "--max-batch", str(BATCH), "--max-request-bytes", str(MAX_BODY), "--no-cache"])
    ranks = ranks_started_with("--parent-pid", lambda value: value == str(s.process.pid))
    assert len(ranks) == 2
    yield s
    s.process.send_signal(signal.SIGTERM)
    assert s.process.wait(timeout=60) == 0, "".join(s.lines)
    assert wait_gone(lambda: [p for p in ranks if p.is_running()]) == [], "ranks outlived the server"


def headless(model: Path, prompt: str, max_tokens: int, raw: bool = False) -> list[dict]:
    args = ["--headless", "--json", "--model", str(model), "--ranks", "2", "--max-tokens", str(max_tokens),
            "--temp", "0", "--no-cache", "--prompt", prompt] + (["--raw"] if raw else [])
    result = subprocess.run([sys.executable, "-m", "cpchat", *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return [e for e in map(json.loads, result.stdout.splitlines()) if e["event"] == "token"]


PROMPT = "Tell me about the quick brown fox."


@pytest.mark.slow
def test_answers_equal_the_headless_greedy_answer_token_for_token(server, model):
    expected = headless(model, PROMPT, 8)
    text = "".join(e["text"] for e in expected)
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=str(model), messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    assert whole.choices[0].message.content == text
    content = whole.choices[0].logprobs.content
    assert [t.token for t in content] == [e["text"] for e in expected]
    assert [t.logprob for t in content] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    for t in content:  # greedy: the chosen token is the most likely one, and the rest follow in order
        lps = [x.logprob for x in t.top_logprobs]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True) and lps[0] == pytest.approx(t.logprob)
    assert whole.usage.completion_tokens == len(expected)
    assert whole.choices[0].finish_reason == ("length" if len(expected) == 8 else "stop")

    chunks = list(client.chat.completions.create(model=str(model), messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(expected) and not chunks[-1].choices

    ids = json.loads(subprocess.run([sys.executable, "-c", "import sys; from cpchat.client.session import "
                                     "load_tokenizer; print(load_tokenizer(sys.argv[1]).encode(sys.argv[2], "
                                     "add_special_tokens=False))", str(model), PROMPT],
                                    capture_output=True, text=True, check=True).stdout)
    raw = headless(model, PROMPT, 6, raw=True)
    completion = client.completions.create(model=str(model), prompt=ids, max_tokens=6, temperature=0)
    assert completion.choices[0].text == "".join(e["text"] for e in raw)


def test_a_long_system_prompt_is_prefilled_once(server, model):
    client = server.client()
    system = " ".join(f"Rule {i}: the fox is quick." for i in range(300))

    def ask(question: str):
        return client.chat.completions.create(model=str(model), max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])

    first, second = ask("What is the first rule?"), ask("And the last one?")
    assert first.usage.prompt_tokens > 1500
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused > 1500 and second.usage.prompt_tokens - reused < 30, second.usage
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - reused


def test_a_stream_that_asks_says_how_far_the_prompt_got(server, model):
    """With `return_progress` (llama.cpp's), chunks carry `prompt_progress` while the prompt is read: its
    tokens, those held already, those done (rising to all of them) and the time; without it none do."""
    client = server.client()
    system = " ".join(f"Note {i}: the vault is north of the river." for i in range(200))

    def ask(question: str, progress: bool) -> list:
        return list(client.chat.completions.create(
            model=str(model), max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            extra_body={"return_progress": True} if progress else None))

    def progress_of(chunks: list) -> list[dict]:
        extras = [c.model_extra or {} for c in chunks]
        return [e["prompt_progress"] for e in extras if "prompt_progress" in e]

    chunks = ask("Where is the vault?", True)
    usage, progress = chunks[-1].usage, progress_of(chunks)
    assert usage.prompt_tokens > 1000 and progress, chunks[:3]
    cached = usage.prompt_tokens_details.cached_tokens
    assert all(p["total"] == usage.prompt_tokens and p["cache"] == cached for p in progress), progress
    done, ms = [p["processed"] for p in progress], [p["time_ms"] for p in progress]
    assert done == sorted(done) and done[0] >= cached and done[-1] == usage.prompt_tokens, progress
    assert ms == sorted(ms) and ms[0] >= 0
    assert all(not c.choices[0].delta.content for c in chunks if (c.model_extra or {}).get("prompt_progress"))
    assert progress_of(ask("Which way is the vault?", False)) == []


def test_metrics_count_what_was_asked_and_what_the_ranks_hold(server, model):
    """/metrics, read by Prometheus's own parser: a request answered adds its tokens, its time to first
    token and one answered chat; a refused one its status; each rank's K/V tokens are what it holds."""
    def scrape() -> dict[tuple, float]:
        return metrics(server)

    before = scrape()
    answer = server.client().chat.completions.create(model=str(model), max_tokens=5, temperature=0,
                                                     messages=[{"role": "user", "content": PROMPT}])
    status, _ = http(server.url + "/v1/chat/completions", json.dumps({"messages": [], "n": 2}).encode())
    after = scrape()

    def added(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    usage = answer.usage
    assert added("cpchat_requests_total", endpoint="chat", outcome="answered") == 1
    assert added("cpchat_prompt_tokens_total") == usage.prompt_tokens
    assert added("cpchat_prompt_tokens_cached_total") == usage.prompt_tokens_details.cached_tokens
    assert added("cpchat_generation_tokens_total") == usage.completion_tokens
    assert added("cpchat_time_to_first_token_seconds_count") == 1
    kept_from = usage.model_extra["cache"]
    assert added("cpchat_requests_by_cache_total", cache=kept_from) == 1
    assert after[("cpchat_conversations_held", ())] == server.health()["held_conversations"] >= 1
    assert status == 400 and added("cpchat_requests_refused_total", status="400") == 1
    assert after[("cpchat_queue_waiting", ())] == 0 and after[("cpchat_batch_size", ())] == 0
    held = {dict(labels)["rank"]: v for (name, labels), v in after.items() if name == "cpchat_rank_kv_tokens"}
    ranks = {str(r["rank"]): r["kv_tokens"] for r in server.health()["ranks"]}
    assert held == ranks and sum(held.values()) >= usage.prompt_tokens  # the conversation's, as the ranks say
    unauthorised = urllib.request.Request(server.url + "/metrics")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(unauthorised, timeout=30)


def asking(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def metrics(server: Server) -> dict[tuple, float]:
    """The server's /metrics, each sample by (name, labels)."""
    request = urllib.request.Request(server.url + "/metrics", headers=AUTH)
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def streamed_text(tokenizer, ids: list[int]) -> str:
    """The text a stream of `ids` shows (an unfinished character at the end is not shown)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in ids:
        detokenizer.add_token(t)
    return detokenizer.text


def test_conversations_return_from_memory_within_the_budget_and_from_disk_past_it(model, tmp_path):
    """Three conversations on a server whose --kv-cache-bytes holds two: a return to one the ranks hold
    prefills only its new tokens from memory; the least recently used goes once a third is held, and a
    return to it loads it from the prefix cache on disk. After every answer no rank holds more than the
    budget (as the ranks report it), and each answer is mlx-lm's."""
    config = json.loads((model / "config.json").read_text())
    token_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    budget = int(2.5 * token_bytes * 1150 / 2)  # two conversations of ~1,150 tokens on each of 2 ranks
    s = start_server(["--model", str(model), "--ranks", "2", "--api-key", KEY,
                      "--kv-cache-bytes", str(budget), "--cache-dir", str(tmp_path)])
    try:
        client, tokenizer = s.client(timeout=300), reference_tokenizer(model)
        prompts = {c: random_prompt(model, 1100, seed=60 + i) for i, c in enumerate("ABC")}

        def ask(c: str, expected_cache: str) -> None:
            ids = prompts[c]
            answer = client.completions.create(model=str(model), prompt=ids, max_tokens=4, temperature=0)
            expected = [t for t, _ in reference_generate(model, ids, 4)]
            assert answer.choices[0].text == streamed_text(tokenizer, expected)
            usage = answer.usage
            assert usage.model_extra["cache"] == expected_cache, (c, usage)
            if expected_cache == "memory":
                assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens <= 12 + 1, usage
            elif expected_cache == "disk":
                assert usage.prompt_tokens_details.cached_tokens >= 1100, usage
            ranks = s.health()["ranks"]
            assert all(r["kv_bytes"] + r["state_bytes"] <= budget for r in ranks), (budget, ranks)
            prompts[c] = ids + expected + random_prompt(model, 12, seed=len(ids))

        for c, cache in (("A", "none"), ("B", "none"), ("A", "memory"), ("B", "memory"), ("C", "none"),
                         ("B", "memory"), ("A", "disk")):
            ask(c, cache)
        assert s.health()["held_conversations"] == 2
    finally:
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)


@pytest.mark.parametrize("which, ranks, kv", [("llama", 2, FULL_PRECISION), ("demo", 1, KVFormat(4, 32, 40)),
                                              ("qwen3_next", 2, FULL_PRECISION)])
def test_concurrent_answers_decode_together_each_as_mlx_lm_alone(model_dir, which, ranks, kv):
    """Six clients at once (prompts of different lengths, answers that end at different steps) while a
    seventh streams a long answer and goes away mid-stream: each answer is mlx-lm's for its prompt
    alone, token for token and logprob for logprob (with 4-bit K/V, mlx-lm's own kv_bits run's; a
    hybrid's linear layers too), the one that went away as far as it got; and the ranks stepped them
    together."""
    model = DEMO_MODEL if which == "demo" else model_dir(which)
    args = ["--model", str(model), "--ranks", str(ranks), "--api-key", KEY, "--no-cache", "--max-batch", "8"]
    if kv.quantized:
        args += ["--kv-bits", str(kv.bits), "--kv-group-size", str(kv.group_size),
                 "--quantized-kv-start", str(kv.start)]
    s = start_server(args)
    reference = MlxReference(model, kv)
    try:
        client, tokenizer = s.client(timeout=300), reference_tokenizer(model)
        lengths, answers = (1, 5, 17, 40, 64, 90), (9, 4, 12, 6, 10, 8)
        prompts = [random_prompt(model, n, seed=80 + n) for n in lengths]
        long_ids = random_prompt(model, 30, seed=99)
        stream = client.completions.create(model=str(model), prompt=long_ids, max_tokens=100_000,
                                           temperature=0, logprobs=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        long = [next(chunks)]  # under way
        got: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, client.completions.create(
            model=str(model), prompt=prompts[i], max_tokens=answers[i], temperature=0, logprobs=0)))
            for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        long += [next(chunks) for _ in range(2)]
        stream.close()  # the client goes away
        for i, ids in enumerate(prompts):
            want = reference(ids, answers[i])[0]
            choice = got[i].choices[0]
            assert choice.text == streamed_text(tokenizer, [t for t, _ in want]), i
            logprobs = choice.logprobs.token_logprobs
            assert max(abs(a - b) for a, (_, b) in zip(logprobs, want, strict=True)) < 1e-3
        long_logprobs = [lp for chunk in long for lp in chunk.choices[0].logprobs.token_logprobs]
        want = reference(long_ids, len(long_logprobs))[0]
        n = min(len(want), len(long_logprobs))
        assert n >= 3 and "".join(c.choices[0].text for c in long) .startswith(
            streamed_text(tokenizer, [t for t, _ in want[:n - 1]]))
        assert max(abs(a - b) for a, (_, b) in zip(long_logprobs[:n], want[:n], strict=True)) < 1e-3
        s.until(lambda h: not h["running"] and h["cancelled"] == 1, "the one that went away let go")
        steps = metrics(s)
        together = steps[("cpchat_decode_step_answers_count", ())] - \
            steps[("cpchat_decode_step_answers_bucket", (("le", "2.0"),))]
        assert together >= 3, "steps of more than two answers"
    finally:
        reference.close()
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)


def test_a_short_request_is_answered_between_a_long_prompts_chunks(model):
    """With --prefill-chunk 2048, a short request sent while a 12,000-token prompt is read gets its whole
    answer before the long one's first token; the long answer is mlx-lm's over the whole prompt, its
    progress rises over all of it, and its usage counts it once."""
    s = start_server(["--model", str(model), "--ranks", "2", "--api-key", KEY, "--no-cache",
                      "--prefill-chunk", "2048"])
    try:
        client = s.client(timeout=300)
        long_ids, short_ids = random_prompt(model, 12_000, seed=5), random_prompt(model, 8, seed=6)
        stream = client.completions.create(model=str(model), prompt=long_ids, max_tokens=6, temperature=0,
                                           logprobs=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"return_progress": True})
        times: dict[str, float] = {}
        short = threading.Thread(target=lambda: times.setdefault("short", (client.completions.create(
            model=str(model), prompt=short_ids, max_tokens=3, temperature=0), time.perf_counter())[1]))
        chunks, progress = [], []
        for chunk in stream:
            if found := (chunk.model_extra or {}).get("prompt_progress"):
                progress.append(found["processed"])
                if not short.is_alive() and "short" not in times:
                    short.start()  # the long prompt is being read
            elif chunk.choices and chunk.choices[0].text:
                times.setdefault("long", time.perf_counter())
            chunks.append(chunk)
        short.join(timeout=300)
        assert times["short"] < times["long"], "the short answer came between the long prompt's chunks"
        assert progress == sorted(progress) and progress[-1] == len(long_ids) and len(progress) >= 5, progress
        want = reference_generate(model, long_ids, 6)
        logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.token_logprobs]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            streamed_text(reference_tokenizer(model), [t for t, _ in want])
        assert max(abs(a - b) for a, (_, b) in zip(logprobs, want, strict=True)) < 1e-3
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(long_ids) and usage.prompt_tokens_details.cached_tokens == 0
    finally:
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)


def test_a_rank_that_dies_fails_its_answer_and_the_server_starts_the_ranks_again(model):
    """A rank killed mid-batch: both streams end with an error naming the rank; the next request finds
    the ranks silent, has fresh ones started and the model loaded, and is answered; no rank of the old
    ring is left running."""
    s = start_server(["--model", str(model), "--ranks", "2", "--api-key", KEY, "--no-cache"])
    try:
        old = ranks_started_with("--parent-pid", lambda value: value == str(s.process.pid))
        client = s.client(timeout=300)
        batch = [iter(client.chat.completions.create(
            model=str(model), messages=[{"role": "user", "content": text}], max_tokens=100_000, stream=True,
            extra_body={"ignore_eos": True})) for text in (PROMPT, "Hi")]
        for chunks in batch:
            for _ in range(3):  # both answers' tokens are coming
                next(chunks)
        old[1].kill()
        for chunks in batch:  # each fails, naming the rank
            with pytest.raises(openai.APIError, match=r"rank \d \(127\.0\.0\.1:\d+\)"):
                for _ in chunks:
                    pass
        messages = [{"role": "user", "content": PROMPT}]
        answer = client.chat.completions.create(model=str(model), messages=messages, max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        assert wait_gone(lambda: [p for p in old if p.is_running()]) == [], "the old ring's ranks are gone"
        new = ranks_started_with("--parent-pid", lambda value: value == str(s.process.pid))
        assert len(new) == 2 and not {p.pid for p in new} & {p.pid for p in old}
        assert any("stopped answering; starting the ranks again" in line for line in s.lines), s.lines
    finally:
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)


def test_a_client_that_goes_away_frees_the_ranks(server, model):
    before = server.health()["cancelled"]
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    # the ranks first hold this prompt (a one-token answer's K/V are never computed), so what the stopped
    # answer leaves them is known: the prompt less its last token, which that answer prefilled again
    client.chat.completions.create(model=str(model), messages=messages, max_tokens=1)
    held = server.health()["held_tokens"]  # of every conversation the ranks keep
    stream = client.chat.completions.create(model=str(model), messages=messages, max_tokens=100_000,
                                            stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    health = server.until(lambda h: not h["running"] and h["cancelled"] == before + 1, "the ranks freed")
    # the answer left the batch where it had got: its conversation holds the prompt and the answer's
    # tokens the ranks read (three at least), and the ranks hold exactly what the session counts
    assert health["held_tokens"] >= held + 2, "held: the prompt and what the stopped answer read"
    assert sum(r["kv_tokens"] for r in health["ranks"]) == health["held_tokens"]
    answer = client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3)
    assert answer.usage.completion_tokens >= 1

    # Without streaming too: a client that gives up waiting for the whole answer stops it
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 100_000,
                       "ignore_eos": True})
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        server.until(lambda h: h["running"], "the answer under way")
    server.until(lambda h: not h["running"] and h["cancelled"] == before + 2, "the ranks freed again")


@pytest.mark.slow
def test_what_is_refused_and_the_server_goes_on(server, model):
    client = server.client()
    user = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key=None).chat.completions.create(model=str(model), messages=user)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    status, bad = http(server.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in bad["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(model), messages=user, extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="acme/other", messages=user)
    limit = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=str(model), prompt=[7] * limit, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    words = json.dumps({"prompt": "word " * (MAX_BODY // 4)}).encode()
    status, big = http(server.url + "/v1/completions", words)
    assert status == 413 and big["error"]["code"] == "request_too_large"
    # One that says it is far larger is refused at once, before a byte of it is sent
    url = urlsplit(server.url)
    connection = HTTPConnection(url.hostname, url.port, timeout=60)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Length": str(1000 * MAX_BODY)}.items():
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()
    answer = client.chat.completions.create(model=str(model), messages=user, max_tokens=2,
                                            extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 2 and answer.choices[0].finish_reason == "length"
    message = answer.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str) and message.content


def test_past_the_queue_bound_429_with_retry_after(server, model):
    client = server.client(timeout=120)
    busy = [client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=100_000, stream=True, extra_body={"ignore_eos": True})
            for _ in range(BATCH)]  # a full batch
    for stream in busy:
        next(iter(stream))
    answers: list = []
    waiting = [threading.Thread(target=lambda: answers.append(client.chat.completions.create(
        model=str(model), messages=[{"role": "user", "content": "Hi"}], max_tokens=2))) for _ in range(QUEUE)]
    for i, thread in enumerate(waiting):
        thread.start()
        server.until(lambda h, i=i: h["waiting"] == i + 1, f"{i + 1} waiting")
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": "Hi"}])
    assert e.value.response.headers["retry-after"].isdigit()
    for stream in busy:
        stream.close()
    for thread in waiting:
        thread.join(timeout=120)
    assert len(answers) == QUEUE, "every waiting request answered once the ranks were free"


@pytest.mark.slow
def test_a_hundred_requests_from_eight_clients_all_answered_memory_flat(model):
    """Eight clients, a hundred requests, on a server that decodes eight answers together: all answered,
    each conversation kept and counted as the ranks count it, and no rank's memory grown."""
    s = start_server(["--model", str(model), "--ranks", "2", "--api-key", KEY, "--no-cache"])
    try:
        client = s.client(timeout=300)
        client.chat.completions.create(model=str(model), max_tokens=3, messages=asking("Hi"))
        before = s.health()
        answers: list = []

        def ask(worker: int) -> None:
            for i in range(worker, 100, 8):
                answers.append((i, client.chat.completions.create(
                    model=str(model), max_tokens=3 + i % 5, messages=asking(f"Question {i}?"))))

        workers = [threading.Thread(target=ask, args=(w,)) for w in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=600)
        assert sorted(i for i, _ in answers) == list(range(100)), "none lost"
        assert all(a.usage.completion_tokens >= 1 for _, a in answers)
        after = s.health()
        assert after["served"] == before["served"] + 100 and not after["running"]
        # each question its own short conversation, kept: the ranks hold what the server counts, no more
        assert all(r["conversations"] == after["held_conversations"] for r in after["ranks"])
        assert sum(r["kv_tokens"] for r in after["ranks"]) == after["held_tokens"]
        for old, new in zip(before["ranks"], after["ranks"], strict=True):
            assert new["rss_bytes"] < old["rss_bytes"] * 1.25 + (32 << 20), (old, new)
        steps = metrics(s)
        assert steps[("cpchat_decode_step_answers_count", ())] > \
            steps[("cpchat_decode_step_answers_bucket", (("le", "1.0"),))], "answers stepped together"
    finally:
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)


def test_the_event_stream_on_the_wire(server, model):
    body = json.dumps({"model": str(model), "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": 4, "stream": True})
    headers = [arg for name, value in AUTH.items() for arg in ("-H", f"{name}: {value}")]
    result = subprocess.run(["curl", "-sSN", server.url + "/v1/chat/completions", *headers, "-d", body],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = result.stdout.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-2] if e.startswith("data: ")]
    assert all(not e or e.startswith(("data: ", ":")) for e in events)
    assert all(d["object"] == "chat.completion.chunk" and d["id"] == data[0]["id"] for d in data)
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_beyond_loopback_needs_a_key_and_a_taken_port_is_one_line(server):
    for args, words in ((["--host", "0.0.0.0"], "give --api-key"),
                        (["--port", server.url.rsplit(":", 1)[1]], "cannot listen on 127.0.0.1")):
        env = {k: v for k, v in os.environ.items() if k != "CPCHAT_API_KEY"}
        result = subprocess.run([sys.executable, "-m", "cpchat", "serve", *args], capture_output=True,
                                text=True, timeout=60, env=env)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_requests_are_read_as_openai_reads_them():
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    request = parse_chat({"model": "m", "messages": [{"role": "developer", "content": parts},
                                                     {"role": "user", "content": "Hi"}],
                          "max_completion_tokens": 5, "stop": "\n", "seed": 3}, "m", DEFAULTS)
    assert request.messages[0] == {"role": "system", "content": "Be brief."}
    assert (request.params.max_tokens, request.params.stop, request.params.seed) == (5, ["\n"], 3)
    user = [{"role": "user", "content": "x"}]
    for body, param in (({"messages": []}, "messages"), ({"messages": user, "n": 2}, "n"),
                        ({"messages": user, "temperature": 3}, "temperature"),
                        ({"messages": user, "stop": ["a"] * 5}, "stop"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]")):
        with pytest.raises(ApiError) as e:
            parse_chat(body, "m", DEFAULTS)
        assert e.value.status == 400 and e.value.param == param


def test_stop_strings_hold_back_what_could_start_one():
    def token(text: str) -> Token:
        return Token(0, 1, text, -0.5)

    stop = StopText(["END", "\n\n"])
    pieces = [stop.add(token(t)) for t in ["The ", "answer", " E", "N", "D here"]]
    assert [p.text for p in pieces] == ["The ", "answer", " ", "", ""]
    assert stop.stopped and "".join(p.text for p in pieces) == "The answer "
    assert [t.text for p in pieces for t in p.tokens] == ["The ", "answer"]
    going = StopText(["END"])
    assert going.add(token("E")).text == "" and going.add(token("ast")).text == "East"
    assert going.flush().text == "" and not going.stopped


@pytest.mark.slow
def test_a_stop_string_inside_a_checked_block_ends_the_answer_there():
    """The demo model quotes the sample document several tokens a step (lookup proposals, serve's
    default): a stop string inside the quote cuts the answer just before it, and the same request
    without it then gets the whole answer (the ranks dropped what they decoded past the stop)."""
    s = start_server(["--model", str(DEMO_MODEL), "--ranks", "2", "--api-key", KEY, "--no-cache"])
    try:
        question = user_message([("sample-doc.txt", SAMPLE_DOC.read_text())],
                                "What is the access code for the Orion vault?")
        ask = {"model": str(DEMO_MODEL), "messages": [{"role": "user", "content": question}],
               "max_tokens": 40, "temperature": 0}
        client = s.client()
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.message.content == "The access code for the Orion vault is 4812-KX."
        cut = client.chat.completions.create(**ask, stop=["12-K"]).choices[0]
        assert cut.message.content == "The access code for the Orion vault is 48"
        assert cut.finish_reason == "stop"
        assert client.chat.completions.create(**ask).choices[0].message.content == whole.message.content
    finally:
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(timeout=60) == 0, "".join(s.lines)
