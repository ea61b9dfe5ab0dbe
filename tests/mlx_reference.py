"""mlx-lm's own answers for a checkpoint, from a child process that multiplies with the fast BLAS the ranks
use (the test process keeps the wheel's reference BLAS, 30x slower for float32 products).

`MlxReference(path)(ids, max_tokens)` -> (greedy answer as (token, logprob) pairs, mlx-lm's own
low-precision noise):
the largest difference, over the answer's tokens, between mlx-lm's logprobs in the checkpoint's form and
those of the same stored weights run in float32. The worker keeps one conversation's prompt cache, so a
later turn of a conversation prefills only its new tokens, as mlx-lm's own chat does. Run as a script it
is the worker: JSON lines in (`{"ids": [...], "max_tokens": n}`), JSON lines out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cpchat.client.launcher import rank_environment


class MlxReference:
    def __init__(self, path: Path) -> None:
        self.worker = subprocess.Popen([sys.executable, __file__, str(path)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=rank_environment(), text=True)
        self.answers: dict[tuple, tuple[list[tuple[int, float]], float]] = {}
        self.pending: list[tuple] = []  # asked, in order, not answered yet

    def submit(self, ids: list[int], max_tokens: int) -> None:
        """Ask without waiting: the worker computes while the caller goes on."""
        key = (tuple(ids), max_tokens)
        if key not in self.answers and key not in self.pending:
            self.worker.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
            self.worker.stdin.flush()
            self.pending.append(key)

    def __call__(self, ids: list[int], max_tokens: int) -> tuple[list[tuple[int, float]], float]:
        self.submit(ids, max_tokens)
        key = (tuple(ids), max_tokens)
        while key not in self.answers:
            reply = json.loads(self.worker.stdout.readline())
            self.answers[self.pending.pop(0)] = [tuple(pair) for pair in reply["answer"]], reply["noise"]
        return self.answers[key]

    def close(self) -> None:
        if self.pending:  # a test failed before it read its answer: do not wait for it
            self.worker.kill()
        self.worker.stdin.close()
        self.worker.wait(timeout=60)


def serve(path: str) -> None:
    import mlx_lm
    from helpers import dense_float32, sequence_logprobs
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(path)
    float32, _ = mlx_lm.load(path)
    dense_float32(float32)
    cached: list[int] = []
    cache = make_prompt_cache(model)
    for line in sys.stdin:
        request = json.loads(line)
        ids = request["ids"]
        if ids[:len(cached)] != cached or len(ids) == len(cached):  # another conversation
            cached, cache = [], make_prompt_cache(model)
        answer = [(r.token, float(r.logprobs[r.token])) for r in mlx_lm.stream_generate(
            model, tokenizer, ids[len(cached):], max_tokens=request["max_tokens"], sampler=make_sampler(0.0),
            prompt_cache=cache)]
        cached = (ids + [t for t, _ in answer])[:cache[0].offset]  # what the cache has read
        if answer[-1][0] in tokenizer.eos_token_ids:  # cpchat stops before the end-of-turn token
            answer = answer[:-1]
        in_float32 = sequence_logprobs(float32, ids + [t for t, _ in answer])[len(ids) - 1:]
        noise = max(abs(lp - f) for (_, lp), f in zip(answer, in_float32, strict=True))
        print(json.dumps({"answer": answer, "noise": noise}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    serve(sys.argv[1])
