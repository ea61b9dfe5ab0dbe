"""Helpers shared by the integration tests."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import mlx_lm
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.sample_utils import make_sampler

from cpchat.client.events import Done, Prefill, Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer


@functools.cache
def reference_model(path: Path):
    return mlx_lm.load(str(path))


def reference_generate(path: Path, ids: list[int], max_tokens: int) -> list[tuple[int, float]]:
    """mlx-lm's own single-process greedy tokens and their logprobs."""
    model, tokenizer = reference_model(path)
    return [
        (r.token, float(r.logprobs[r.token]))
        for r in mlx_lm.stream_generate(
            model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0)
        )
    ]


def random_prompt(path: Path, length: int, seed: int) -> list[int]:
    _, tokenizer = reference_model(path)
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



def sequence_logprobs(model, sequence: list[int]) -> list[float]:
    """log p(sequence[i + 1] | sequence[: i + 1]) for every i, from one forward of `model`."""
    import mlx.core as mx

    logits = model(mx.array([sequence[:-1]]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logprobs[mx.arange(len(sequence) - 1), mx.array(sequence[1:])].tolist()


def run_in_float32(model) -> None:
    """Cast every floating parameter of `model` to float32 (quantized words stay as they are)."""
    import mlx.core as mx

    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))


def float32_weight(module):
    """A layer's weight in float32; a quantized one dequantized with its scales in float32."""
    import mlx.core as mx

    if "scales" not in module:
        return module.weight.astype(mx.float32)
    return mx.dequantize(module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
                         module.group_size, module.bits)


def low_precision_noise(path: Path, ids: list[int], expected: list[tuple[int, float]]) -> float:
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


def agreeing_steps(path: Path, ids: list[int], got: list[tuple[int, float]],
                   expected: list[tuple[int, float]], noise: float) -> int:
    """How many greedy steps cpchat and mlx-lm agree on: all of them, or those before a step where the
    two picks are a tie at the checkpoint's precision — mlx-lm's own forward scores them within 1.5x
    its low-precision noise of each other, and the same weights run in float32 rank cpchat's pick no
    lower than mlx-lm's. Any other difference fails. (A random model's flat logits meet such ties:
    cpchat's decode multiplies in float32, mlx-lm's in its low-precision kernels.)"""
    import mlx.core as mx

    ours, theirs = [t for t, _ in got], [t for t, _ in expected]
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if step is None:
        assert len(ours) == len(theirs), f"{len(ours)} tokens, mlx-lm {len(theirs)}"
        return len(ours)
    model, _ = mlx_lm.load(str(path))

    def scores() -> tuple[float, float]:
        logits = model(mx.array([ids + theirs[:step]]))[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        return logprobs[ours[step]].item(), logprobs[theirs[step]].item()

    mine, its = scores()
    run_in_float32(model)
    mine_32, its_32 = scores()
    assert abs(mine - its) <= 1.5 * noise and mine_32 >= its_32, (
        f"step {step}: cpchat picked {ours[step]}, mlx-lm {theirs[step]}; mlx-lm scores them {mine:.4f} and "
        f"{its:.4f} (noise {noise:.4f}), in float32 {mine_32:.4f} and {its_32:.4f}")
    return step


def dense_float32(model) -> None:
    """Replace `model`'s quantized layers by float32 ones holding the same stored weights (dequantized with
    the scales in float32): the same weights run in float32, through fast dense products."""
    import mlx.core as mx
    import mlx.nn as nn

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
