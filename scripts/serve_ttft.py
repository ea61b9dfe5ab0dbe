"""TTFT of `cpchat serve` for a long system prompt sent with every request: the first request prefills
it, the second (another question after the same system prompt) reuses the ranks' K/V.

    python scripts/serve_ttft.py [--model M] [--ranks 2] [--tokens 16384]

Starts a real server (a fresh prefix cache, so nothing is on disk before), streams two chat requests
through plain HTTP and prints, for each, the time to the first content chunk as the client saw it,
the server's own TTFT (`usage.ttft_ms`) and the prompt tokens it reused (`usage.prompt_tokens_details`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from serve_load import sample_ids


def ask(url: str, system: str, question: str) -> tuple[float, dict]:
    """Client-side TTFT (ms) and the usage of one streamed chat request."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = json.dumps({"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    t0, first, usage = time.perf_counter(), None, {}
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return 1000 * ((first or time.perf_counter()) - t0), usage


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16384, help="the system prompt's length in tokens")
    args = p.parse_args()
    tokenizer, ids = sample_ids(args.model, args.tokens)
    ids = ids[: args.tokens]
    system = tokenizer.decode(ids)
    with tempfile.TemporaryDirectory() as cache:
        command = [sys.executable, "-m", "cpchat", "serve", "--port", "0", "--ranks", str(args.ranks),
                   "--cache-dir", cache] + (["--model", args.model] if args.model else [])
        server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            for line in server.stderr:
                if found := re.search(r"listening on (http://[\d.]+:\d+)", line):
                    break
            else:
                raise SystemExit("the server did not start")
            rows = [ask(found.group(1), system, q) for q in ("What is the access code for the Orion vault?",
                                                              "What is the gate code for the Hollow mill?")]
        finally:
            server.terminate()
            server.wait()
    print(f"`{' '.join(['python', *sys.argv])}`: {len(tokenizer.encode(system)):,}-token system prompt, "
          f"{args.ranks} ranks\n")
    print("| request | TTFT at the client, ms | server's TTFT, ms | prompt tokens | reused |")
    print("|---|---:|---:|---:|---:|")
    for name, (client_ms, usage) in zip(("first", "second"), rows, strict=True):
        print(f"| {name} | {client_ms:,.0f} | {usage['ttft_ms']:,.0f} | {usage['prompt_tokens']:,} | "
              f"{usage['prompt_tokens_details']['cached_tokens']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
