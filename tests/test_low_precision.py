"""Checkpoints as people download them — bfloat16, float16, and 4- / 8-bit quantized from bfloat16
with mlx_lm.convert — through real rank processes: greedy tokens identical to mlx-lm's own
generation on the same checkpoint, and every logprob within 1.5x of mlx-lm's own low-precision
noise (its logprobs in the checkpoint's dtype vs the same stored weights run in float32)."""

import functools
import random

import pytest
from helpers import (
    low_precision_noise,
    next_turn,
    raw_session,
    reference_generate,
    reference_model,
    run_raw,
)

from cpchat.demo.data import make_example

FORMS = ("bfloat16", "float16", "q4g32", "q4g64", "q4g128", "q8g64")
MAX_TOKENS = 16


@functools.cache
def reference(path, ids: tuple[int, ...]) -> tuple[list[tuple[int, float]], float]:
    """mlx-lm's generation (without the end-of-turn token, which cpchat does not emit) and its noise."""
    expected = reference_generate(path, list(ids), MAX_TOKENS)
    if expected[-1][0] in reference_model(path)[1].eos_token_ids:
        expected = expected[:-1]
    return expected, low_precision_noise(path, list(ids), expected)


def assert_within_noise(path, ids, got):
    expected, noise = reference(path, tuple(ids))
    assert [t for t, _ in got] == [t for t, _ in expected]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert worst <= 1.5 * noise, f"logprobs off by {worst:.4f}; mlx-lm's own noise is {noise:.4f}"


def question_ids(path, seed: int, n_questions: int = 1) -> tuple[list[int], list[str]]:
    """A demo document with a question, as chat-template token ids, and the later questions."""
    example = make_example(random.Random(seed), 30, n_questions=n_questions)
    _, tokenizer = reference_model(path)
    first = example.messages()[0]
    ids = tokenizer.apply_chat_template([first], add_generation_prompt=True)
    return ids, [q for q, _ in example.turns[1:]]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("form", FORMS)
def test_checkpoint_forms_through_ranks(clusters, checkpoint, form, ranks):
    path = checkpoint(form)
    cluster = clusters.get(ranks, path)
    ids, _ = question_ids(path, seed=1)
    for algorithm in ("pass_kv", "pass_q", "all_gather", "ulysses"):
        cluster.reset(0)
        got, _, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS)
        assert_within_noise(path, ids, got)


@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_follow_up_turns_in_low_precision(clusters, checkpoint, form):
    """Three questions about one document through 3 ranks (all-gather, then Ulysses, then auto), each
    later turn prefilling only its new tokens, equal mlx-lm over the whole conversation."""
    path = checkpoint(form)
    cluster = clusters.get(3, path)
    _, tokenizer = reference_model(path)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    ids, questions = question_ids(path, seed=11, n_questions=3)
    turns = [ids] + [tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                      add_special_tokens=False) for q in questions]
    history: list[int] = []
    for new, algorithm in zip(turns, ("all_gather", "ulysses", "auto"), strict=True):
        session.algorithm = algorithm
        got, _ = next_turn(session, new)
        history += new
        assert_within_noise(path, history, got)
        history += [t for t, _ in got]
    assert cluster.size == 3 and session.turn_index == 3


@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_prefill_blocks_multiply_in_float32_on_the_cpu(checkpoint, form):
    """On the CPU a rank computes a block's weight products in float32 from the stored weights (MLX's
    low-precision CPU kernels are 15-100x slower); a decode token keeps the native kernel, bit for bit."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    from cpchat.rank.cpu_products import MIN_ROWS, use_float32_products

    model, _ = mlx_lm.load(str(checkpoint(form)))
    layer = model.layers[0].mlp.down_proj
    native = type(layer)
    assert use_float32_products(model) == 7 * len(model.layers)  # q, k, v, o, gate, up, down
    x = mx.random.normal((1, MIN_ROWS, model.args.intermediate_size)).astype(mx.bfloat16)
    weight = layer.weight
    if native is nn.QuantizedLinear:
        weight = mx.dequantize(weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    exact = x.astype(mx.float32) @ weight.astype(mx.float32).T
    assert mx.allclose(layer(x).astype(mx.float32), exact, rtol=1e-2, atol=1e-2).item()
    one = x[:, :1]
    assert mx.array_equal(layer(one), native.__call__(layer, one)).item()
