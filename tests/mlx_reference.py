"""The oracle: mlx-lm's own answers, which every exactness test holds cpchat to. Everything here runs
mlx-lm as it is, on the test's model directory; tests/references.py keeps what it computes on disk,
so a change to this file computes every reference again.

In the test process (the wheel's BLAS): greedy generation with its logprobs and most likely tokens,
the low-precision noise, the scores of a tie, where generate_step starts reading quantized K/V.

Run as a script it is the worker (`references.MlxReference`), multiplying with the fast BLAS the ranks
use: JSON lines in (`{"ids": [...], "max_tokens": n, "reset": bool}`), JSON lines out (`{"answer":
[[token, logprob], ...], "noise": x}`). It keeps one conversation's prompt cache, so a later turn of a
conversation prefills only its new tokens, as mlx-lm's own chat does; `reset` starts another. The noise
is mlx-lm's own low-precision error over the new tokens and the answer: its logprobs in the checkpoint's
form against the same stored weights run in float32 (with kv_bits: both with the same kv_bits, reading
the same tokens in the same calls).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.sample_utils import make_sampler


@functools.cache
def load(path: Path):
    """mlx-lm's model and tokenizer for `path`, loaded once (lazily: a test that needs the tokenizer only
    never evaluates the weights)."""
    return mlx_lm.load(str(path), lazy=True)


def generate(path: Path, ids: list[int], max_tokens: int, top: int = 0) -> list[list]:
    """mlx-lm's greedy generation: per token [token, logprob], and with `top` the `top` most likely
    tokens as [[token, logprob], ...]."""
    model, tokenizer = load(path)
    steps = []
    for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        step = [r.token, r.logprobs[r.token].item()]
        if top:
            best = mx.argsort(-r.logprobs)[:top].tolist()
            step.append([[i, r.logprobs[i].item()] for i in best])
        steps.append(step)
    return steps


def sequence_logprobs(model, sequence: list[int]) -> list[float]:
    """log p(sequence[i + 1] | sequence[: i + 1]) for every i, from one forward of `model`."""
    logits = model(mx.array([sequence[:-1]]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logprobs[mx.arange(len(sequence) - 1), mx.array(sequence[1:])].tolist()


def run_in_float32(model) -> None:
    """Cast every floating parameter of `model` to float32 (quantized words stay as they are)."""
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))


def float32_weight(module):
    """A layer's weight in float32; a quantized one dequantized with its scales in float32."""
    if "scales" not in module:
        return module.weight.astype(mx.float32)
    return mx.dequantize(module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
                         module.group_size, module.bits)


def dense_float32(model) -> None:
    """Replace `model`'s quantized layers by float32 ones holding the same stored weights (dequantized with
    the scales in float32): the same weights run in float32, through fast dense products."""

    def dense(module):
        w = float32_weight(module)
        if isinstance(module, nn.QuantizedEmbedding):
            layer = nn.Embedding(*w.shape)
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
            if "bias" in module:
                layer.bias = module.bias.astype(mx.float32)
        layer.weight = w
        return layer

    swaps = [(name, dense(m)) for name, m in model.named_modules()
             if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)]
    model.update_modules(tree_unflatten(swaps))
    run_in_float32(model)


def low_precision_noise(path: Path, ids: list[int], expected: list[list]) -> float:
    """mlx-lm's own low-precision noise: the largest logprob difference between the checkpoint run in
    its dtype and the same stored weights run in float32, over every position of the prompt and the
    answer (teacher-forced), and over `expected` (mlx-lm's generation in the checkpoint's dtype)."""
    model, _ = mlx_lm.load(str(path))
    sequence = ids + [t for t, _ in expected]
    in_dtype = sequence_logprobs(model, sequence)
    run_in_float32(model)
    in_float32 = sequence_logprobs(model, sequence)
    generated = in_float32[len(ids) - 1 :]
    return max(
        max(abs(a - b) for a, b in zip(in_dtype, in_float32, strict=True)),
        max(abs(lp - b) for (_, lp), b in zip(expected, generated, strict=True)),
    )


def tie_scores(path: Path, prefix: list[int], tokens: list[int]) -> list[list[float]]:
    """The logprobs of `tokens` after `prefix`: [in the checkpoint's dtype, the same weights in float32]."""
    model, _ = mlx_lm.load(str(path))

    def scores() -> list[float]:
        logits = model(mx.array([prefix]))[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        return [logprobs[t].item() for t in tokens]

    in_dtype = scores()
    run_in_float32(model)
    return [in_dtype, scores()]


def quantized_reads(path: Path, turns: list[int], start: int, bits: int = 4, group_size: int = 64) -> list:
    """Where generate_step starts to read quantized K/V: for every forward it makes over turns of
    `turns` tokens (prompts 0, 1, 2, ... mod 500; three tokens generated in the first turn, two in the
    others) with one prompt cache, [its first position, whether the cache was quantized by then]."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(path)
    calls: list[list] = []

    def recorder(inputs, cache=None, **kwargs):
        calls.append([cache[0].offset, hasattr(cache[0], "bits")])
        return model(inputs, cache=cache, **kwargs)

    cache = make_prompt_cache(model)
    for turn, length in enumerate(turns):
        prompt = mx.array([i % 500 for i in range(length)])
        for _ in generate_step(prompt, recorder, max_tokens=3 if turn == 0 else 2, sampler=make_sampler(0.0),
                               prompt_cache=cache, kv_bits=bits, kv_group_size=group_size,
                               quantized_kv_start=start):
            pass
    return calls


def serve(path: str, kv_bits: int, kv_group_size: int, quantized_kv_start: int) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_lm.load(path)
    float32, _ = mlx_lm.load(path)
    dense_float32(float32)
    kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start} \
        if kv_bits else {}
    cached: list[int] = []
    for line in sys.stdin:
        request = json.loads(line)
        ids = request["ids"]
        if request["reset"] or ids[:len(cached)] != cached or len(ids) == len(cached):  # another conversation
            cached, cache = [], make_prompt_cache(model)
            # with kv_bits, the same weights read teacher-forced in their dtype and in float32
            forced, forced32 = make_prompt_cache(model), make_prompt_cache(float32)
        new = ids[len(cached):]
        answer = [(r.token, float(r.logprobs[r.token])) for r in mlx_lm.stream_generate(
            model, tokenizer, new, max_tokens=request["max_tokens"], sampler=make_sampler(0.0),
            prompt_cache=cache, **kv)]
        read = next(c.offset for c in cache if hasattr(c, "offset"))  # a linear layer's state keeps none
        cached = (ids + [t for t, _ in answer])[:read]  # what the cache has read
        tokens = [t for t, _ in answer]
        if kv:  # every position of the new tokens and the answer, read in the calls generate_step makes
            reads = read - (len(ids) - len(new))
            in_dtype, in_float32 = (forced_logprobs(m, c, new, tokens, reads, kv) for m, c in
                                    ((model, forced), (float32, forced32)))
        if answer[-1][0] in tokenizer.eos_token_ids:  # cpchat stops before the end-of-turn token
            answer = answer[:-1]
        prompt = len(new) - 1  # positions of the new tokens before the answer's (with kv_bits)
        if not kv:  # over the answer
            in_dtype, prompt = [], 0
            sequence = ids + tokens[:len(answer)]
            in_float32 = sequence_logprobs(float32, sequence)[len(ids) - 1:] if answer else []
        noise = max([abs(a - b) for a, b in zip(in_dtype[:prompt], in_float32[:prompt])]
                    + [abs(lp - b) for (_, lp), b in zip(answer, in_float32[prompt:])], default=0.0)
        print(json.dumps({"answer": answer, "noise": noise}), flush=True)


def forced_logprobs(model, cache: list, new: list[int], answer: list[int], reads: int,
                    kv: dict) -> list[float]:
    """Each token's logprob after those before it, over `new` (from its second token on) and `answer`:
    the first `reads` of their tokens (those the generation's own cache read) read into `cache` in the
    calls mlx-lm's generate_step makes (the prompt in chunks but its last token, then a token a call,
    quantizing after each), each answer token read as if sampled."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    sequence = new + answer

    def call(start: int, end: int) -> list[float]:
        """Read sequence[start:end]; the logprobs of the tokens after each."""
        logits = model(mx.array([sequence[start:end]]), cache=cache)[0].astype(mx.float32)
        maybe_quantize_kv_cache(cache, kv["quantized_kv_start"], kv["kv_group_size"], kv["kv_bits"])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = sequence[start + 1:end + 1]
        return logprobs[mx.arange(len(targets)), mx.array(targets)].tolist() if targets else []

    out, start = [], 0
    while len(new) - start > 1:
        end = start + min(2048, len(new) - 1 - start)
        out += call(start, end)
        start = end
    for start in range(len(new) - 1, reads):
        out += call(start, start + 1)
    return out[:len(sequence) - 1]


if __name__ == "__main__":
    serve(sys.argv[1], *map(int, sys.argv[2:5]))
