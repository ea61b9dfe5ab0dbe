"""A short request sent while `cpchat serve` reads a long prompt: how long it waits for its first token,
with the long prompt read whole and in chunks (--prefill-chunk).

    python scripts/serve_interrupt.py [--model M] [--ranks 2] [--context 32768] [--chunks 0,8192,2048]

Prints, per chunk size: the short request's time to first token (sent once the long prompt's first
progress event has come) and the long one's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request

from serve_load import free_port, sample_ids, serving


def stream(url: str, text: str, answer: int, on_progress=None) -> float:
    """Seconds to the first token of a streamed chat request; `on_progress` is called at its first
    prompt progress chunk."""
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": answer, "stream": True,
                       "temperature": 0, "return_progress": on_progress is not None}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    with urllib.request.urlopen(request, timeout=7200) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "prompt_progress" in chunk and on_progress is not None:
                on_progress()
                on_progress = None
            elif any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                return time.perf_counter() - sent
    return time.perf_counter() - sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--context", type=int, default=32768, help="the long prompt, in tokens")
    p.add_argument("--chunks", default="0,8192,2048", help="--prefill-chunk values to try")
    args = p.parse_args()
    tokenizer, ids = sample_ids(args.model, args.context + 16)
    print(f"`{' '.join(['python', *sys.argv])}`\n")
    print("| --prefill-chunk | short request's TTFT, s | long prompt's TTFT, s |")
    print("|---:|---:|---:|")
    for i, chunk in enumerate(map(int, args.chunks.split(","))):
        port = free_port()
        model = ["--model", args.model] if args.model else []
        command = [sys.executable, "-m", "cpchat", "serve", "--port", str(port), "--ranks", str(args.ranks),
                   "--no-cache", "--prefill-chunk", str(chunk), *model]
        server, url = serving(subprocess.Popen(command, stderr=subprocess.DEVNULL), port, "cpchat")
        try:
            stream(url, "Hello.", 4)  # the first request's one-off costs, outside the figures
            document = tokenizer.decode(ids[i * 7:i * 7 + args.context])  # not a prefix of the last one
            short: list[float] = []
            asker = threading.Thread(target=lambda u=url, s=short: s.append(stream(u, "What is a fox?", 8)))
            long = stream(url, document + "\n\nSum it up.", 8, on_progress=asker.start)
            asker.join()
            print(f"| {chunk} | {short[0]:.1f} | {long:.1f} |", flush=True)
        finally:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
