"""mlx-lm's own answers for a checkpoint, from a child process that multiplies with the fast BLAS the ranks
use (the test process keeps the wheel's reference BLAS, 30x slower for float32 products).

`MlxReference(path)(ids, max_tokens)` -> (greedy answer as (token, logprob) pairs, mlx-lm's own
low-precision noise):
the largest difference, over the answer's tokens, between mlx-lm's logprobs in the checkpoint's form and
those of the same stored weights run in float32. The worker keeps one conversation's prompt cache, so a
later turn of a conversation prefills only its new tokens, as mlx-lm's own chat does. With `kv` (a
KVFormat) mlx-lm generates with kv_bits, kv_group_size and quantized_kv_start; the noise is then the
largest difference from the same weights in float32 with the same kv_bits (the same calls, the answer's
tokens read as sampled), or from the checkpoint without kv_bits (the quantization's own error), or the
checkpoint's own low-precision noise over the prompt and answer (as helpers.low_precision_noise has it).
Run as a script it is the worker: JSON lines in (`{"ids": [...], "max_tokens": n}`), JSON lines out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cpchat.client.launcher import rank_environment
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat


class MlxReference:
    def __init__(self, path: Path, kv: KVFormat = FULL_PRECISION) -> None:
        kv_args = [str(kv.bits), str(kv.group_size), str(kv.start)]
        self.worker = subprocess.Popen([sys.executable, __file__, str(path), *kv_args], stdin=subprocess.PIPE,
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


def serve(path: str, kv_bits: int, kv_group_size: int, quantized_kv_start: int) -> None:
    import mlx_lm
    from helpers import dense_float32, sequence_logprobs
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(path)
    float32, _ = mlx_lm.load(path)
    dense_float32(float32)
    kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start} \
        if kv_bits else {}
    cached: list[int] = []
    cache, cache32 = make_prompt_cache(model), make_prompt_cache(float32)
    for line in sys.stdin:
        request = json.loads(line)
        ids = request["ids"]
        if ids[:len(cached)] != cached or len(ids) == len(cached):  # another conversation
            cached, cache, cache32 = [], make_prompt_cache(model), make_prompt_cache(float32)
        new = ids[len(cached):]
        answer = [(r.token, float(r.logprobs[r.token])) for r in mlx_lm.stream_generate(
            model, tokenizer, new, max_tokens=request["max_tokens"], sampler=make_sampler(0.0),
            prompt_cache=cache, **kv)]
        read = next(c.offset for c in cache if hasattr(c, "offset"))  # a linear layer's state keeps none
        cached = (ids + [t for t, _ in answer])[:read]  # what the cache has read
        if kv:  # the same weights in float32 with the same kv_bits, reading the same tokens in the same calls
            in_float32 = forced_logprobs(float32, cache32, new, [t for t, _ in answer], kv)
        if answer[-1][0] in tokenizer.eos_token_ids:  # cpchat stops before the end-of-turn token
            answer = answer[:-1]
        sequence = ids + [t for t, _ in answer]
        noise = 0.0
        if len(sequence) < 2:  # nothing answered: nothing to compare
            others = []
        elif kv:  # and the quantization's own error: the checkpoint without kv_bits
            in_dtype = sequence_logprobs(model, sequence)
            others = [in_float32, in_dtype[len(ids) - 1:]]
            # and the checkpoint's low-precision error, over the prompt too (helpers.low_precision_noise)
            noise = max(abs(a - b) for a, b in zip(in_dtype, sequence_logprobs(float32, sequence)))
        else:
            others = [sequence_logprobs(float32, sequence)[len(ids) - 1:]]
        noise = max([noise, *(abs(lp - o) for other in others for (_, lp), o in zip(answer, other))])
        print(json.dumps({"answer": answer, "noise": noise}), flush=True)


def forced_logprobs(model, cache: list, new: list[int], answer: list[int], kv: dict) -> list[float]:
    """The logprobs of `answer` after `new`, read into `cache` in the calls mlx-lm's generate_step makes
    (the prompt in chunks but its last token, then a token a call, quantizing after each), each answer
    token read as if sampled."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache

    def call(tokens: list[int]) -> mx.array:
        logits = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        maybe_quantize_kv_cache(cache, kv["quantized_kv_start"], kv["kv_group_size"], kv["kv_bits"])
        return logits - mx.logsumexp(logits)

    while len(new) > 1:
        n = min(2048, len(new) - 1)
        call(new[:n])
        new = new[n:]
    logprobs, out = call(new), []
    for token in answer:
        out.append(float(logprobs[token]))
        logprobs = call([token])
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    serve(sys.argv[1], *map(int, sys.argv[2:5]))
