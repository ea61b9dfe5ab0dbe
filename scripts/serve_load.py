"""Many clients at once against `cpchat serve` or `mlx_lm.server`: each sends its own document and a
question, streamed, with a fixed answer length, all at the same moment; then as many requests one
after another. Every request has a document of its own, of the same length (neither server can
reuse another's K/V; cpchat runs without its prefix cache).

    python scripts/serve_load.py [--server cpchat|mlx_lm] [--model M] [--ranks 2]
                                 [--clients 1,4,8] [--context 4096] [--answer 128] [--serve-args ARGS]

Prints, per client count: the tokens generated over the wall time from the first request sent to
the last answer's end (aggregate tokens/s), the tokens after each answer's first over the time some
answer was decoding (decode tokens/s), the time to first token at the client (p50, p95), and the
same for the requests sent one after another.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from cpchat.client.hub import front_end_copy
from cpchat.client.session import load_tokenizer
from cpchat.client.settings import bundled, resolve_model


@dataclass
class Answer:
    sent: float
    first: float
    end: float
    tokens: int


def ask(url: str, document: str, answer: int, no_end: dict) -> Answer:
    """One streamed request; `no_end` keeps its answer going to `answer` tokens (each server's way)."""
    messages = [{"role": "user", "content": f"{document}\n\nRetell the text above, in order."}]
    body = json.dumps({"messages": messages, "max_tokens": answer, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, **no_end}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    sent, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=7200) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return Answer(sent, first or end, end, tokens)


def together(url: str, documents: list[str], answer: int, no_end: dict) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(documents)

    def run(i: int) -> None:
        answers[i] = ask(url, documents[i], answer, no_end)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(documents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [a for a in answers if a is not None]


def decoding_s(answers: list[Answer]) -> float:
    """Seconds in which some answer was decoding (between its first token and its end)."""
    total, reach = 0.0, float("-inf")
    for a in sorted(answers, key=lambda a: a.first):
        total += max(0.0, a.end - max(a.first, reach))
        reach = max(reach, a.end)
    return total


def row(name: str, answers: list[Answer]) -> str:
    wall = max(a.end for a in answers) - min(a.sent for a in answers)
    ttft = np.array([a.first - a.sent for a in answers])
    tokens = sum(a.tokens for a in answers)
    decode = sum(a.tokens - 1 for a in answers) / decoding_s(answers)
    return (f"| {name} | {len(answers)} | {tokens:,} | {tokens / wall:.1f} | {decode:.1f} | "
            f"{np.percentile(ttft, 50):.1f} | {np.percentile(ttft, 95):.1f} |")


def start(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if args.server == "cpchat":
        command = [sys.executable, "-m", "cpchat", "serve", "--port", str(port), "--ranks", str(args.ranks),
                   "--no-cache", "--max-queue", "64", *args.serve_args.split()] + \
            (["--model", args.model] if args.model else [])
    else:
        command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(resolve_model(args.model)[0]),
                   "--port", str(port), "--max-tokens", str(args.answer)]
    return serving(subprocess.Popen(command, stderr=subprocess.DEVNULL), port, args.server)


def sample_ids(model: str, tokens: int) -> tuple[object, list[int]]:
    """The model's tokenizer, and the bundled sample document repeated to at least `tokens` token ids."""
    tokenizer = load_tokenizer(front_end_copy(resolve_model(model)[0], whole_model=False))
    text = bundled("sample-doc.txt").read_text(encoding="utf-8")
    return tokenizer, tokenizer.encode(text * (tokens // len(tokenizer.encode(text)) + 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(server: subprocess.Popen, port: int, name: str) -> tuple[subprocess.Popen, str]:
    """The server once it answers on `port` (at most 10 minutes), and its URL."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).close()
            return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"{name} did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=("cpchat", "mlx_lm"), default="cpchat")
    p.add_argument("--model", default="")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--context", type=int, default=4096, help="each client's document, in tokens")
    p.add_argument("--answer", type=int, default=128, help="tokens each answer is asked for")
    p.add_argument("--serve-args", default="", help="more options for cpchat serve, e.g. '--max-batch 1'")
    args = p.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    need = 2 * sum(counts)
    tokenizer, ids = sample_ids(args.model, args.context * need)
    documents = iter([tokenizer.decode(ids[i * args.context:(i + 1) * args.context]) for i in range(need)])
    print(f"`{' '.join(['python', *sys.argv])}`\n")
    print("| requests | clients | tokens | aggregate tokens/s | decode tokens/s | TTFT p50, s | "
          "TTFT p95, s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    # cpchat takes vLLM's and llama.cpp's ignore_eos; mlx_lm.server a bias against the end tokens
    no_end = {"ignore_eos": True} if args.server == "cpchat" else {
        "logit_bias": {str(t): -1e9 for t in tokenizer.eos_token_ids}}
    server, url = start(args)
    try:
        ask(url, "Hello.", 4, no_end)  # the first request's one-off costs, outside the figures
        for n in counts:
            batch = [next(documents) for _ in range(n)]
            print(row("together", together(url, batch, args.answer, no_end)), flush=True)
            batch = [next(documents) for _ in range(n)]
            print(row("one at a time", [ask(url, d, args.answer, no_end) for d in batch]), flush=True)
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
