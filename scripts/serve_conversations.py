"""Conversations in turn against `cpchat serve`: each of N conversations its own document and a
question, then, round after round, one more question in each, in turn (A B C A B C ...). Where the
ranks keep the conversations, a return to one prefills only its new question; where they let them go,
it comes back from the prefix cache on disk or is read again.

    python scripts/serve_conversations.py [--model M] [--ranks 2] [--conversations 3] [--rounds 3]
                                          [--tokens 4096] [--serve-args "--kv-cache-bytes 1"]

Starts a real server with a fresh prefix cache. Prints a line per request (its conversation and
round, where the kept tokens came from, the prompt tokens and those kept, the server's time to first
token) and the median TTFT by where they came from.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict

import numpy as np
from serve_load import free_port, sample_ids, serving


def ask(url: str, messages: list[dict]) -> dict:
    body = json.dumps({"messages": messages, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=7200) as response:
        return json.loads(response.read())


def start(args: argparse.Namespace, cache_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "cpchat", "serve", "--port", str(port), "--ranks", str(args.ranks),
               "--cache-dir", cache_dir, *(["--model", args.model] if args.model else []),
               *shlex.split(args.serve_args)]
    return serving(subprocess.Popen(command, stderr=subprocess.DEVNULL), port, "cpchat serve")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="each conversation's document, in tokens")
    p.add_argument("--serve-args", default="", help="more options for cpchat serve")
    args = p.parse_args()
    n = args.conversations
    tokenizer, ids = sample_ids(args.model, args.tokens * n)
    chats = [[{"role": "user", "content": tokenizer.decode(ids[i * args.tokens:(i + 1) * args.tokens])
               + "\n\nWhat is this text about?"}] for i in range(n)]
    print(f"`{shlex.join(['python', *sys.argv])}`\n")
    print("| conversation | round | kept from | prompt tokens | kept | server TTFT, s |")
    print("|---|---:|---|---:|---:|---:|")
    ttfts: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as cache_dir:
        server, url = start(args, cache_dir)
        try:
            for r in range(args.rounds):
                for c, chat in enumerate(chats):
                    reply = ask(url, chat)
                    usage = reply["usage"]
                    kept, ttft = usage["prompt_tokens_details"]["cached_tokens"], usage["ttft_ms"] / 1000
                    ttfts[usage["cache"]].append(ttft)
                    print(f"| {chr(ord('A') + c)} | {r + 1} | {usage['cache']} | "
                          f"{usage['prompt_tokens']:,} | {kept:,} | {ttft:.2f} |", flush=True)
                    chat += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And what comes next? ({r})"}]
        finally:
            server.terminate()
            server.wait()
    print()
    for cache, values in ttfts.items():
        print(f"- {cache}: median TTFT {np.median(values):.2f} s over {len(values)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
