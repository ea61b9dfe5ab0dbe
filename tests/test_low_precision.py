"""Checkpoints as people download them — bfloat16, float16, and 4- / 8-bit quantized from bfloat16
with mlx_lm.convert — through real rank processes: greedy tokens identical to mlx-lm's own
generation on the same checkpoint, and every logprob within 1.5x of mlx-lm's own low-precision
noise (its logprobs in the checkpoint's dtype vs the same stored weights run in float32)."""

import functools
import itertools

import pytest
from helpers import next_turn, question_ids, raw_session, run_raw
from mlx_reference import float32_weight
from references import low_precision_noise, reference_generate, reference_tokenizer

from cpchat.client.cluster import Cluster
from cpchat.client.events import Done

FORMS = ("bfloat16", "float16", "q4g32", "q4g64", "q4g128", "q8g64")
MAX_TOKENS = 16


@functools.cache
def reference(path, ids: tuple[int, ...]) -> tuple[list[tuple[int, float]], float]:
    """mlx-lm's generation (without the end-of-turn token, which cpchat does not emit) and its noise."""
    expected = reference_generate(path, list(ids), MAX_TOKENS)
    if expected[-1][0] in reference_tokenizer(path).eos_token_ids:
        expected = expected[:-1]
    return expected, low_precision_noise(path, list(ids), expected)


def assert_within_noise(path, ids, got):
    expected, noise = reference(path, tuple(ids))
    assert [t for t, _ in got] == [t for t, _ in expected]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert worst <= 1.5 * noise, f"logprobs off by {worst:.4f}; mlx-lm's own noise is {noise:.4f}"


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_follow_up_turns_in_low_precision(clusters, checkpoint, form):
    """Three questions about one document through 3 ranks (all-gather, then Ulysses, then auto), each
    later turn prefilling only its new tokens, equal mlx-lm over the whole conversation."""
    path = checkpoint(form)
    cluster = clusters.get(3, path)
    tokenizer = reference_tokenizer(path)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    ids, questions = question_ids(path, seed=11, n_questions=3)
    turns = [ids] + [tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                      add_special_tokens=False) for q in questions]
    history: list[int] = []
    for new, algorithm in zip(turns, ("all_gather", "ulysses", "auto"), strict=True):
        session.planner.algorithm = algorithm
        got, _ = next_turn(session, new)
        history += new
        assert_within_noise(path, history, got)
        history += [t for t, _ in got]
    assert cluster.size == 3 and session.turn_index == 3


def float32_bytes(model) -> int:
    """Bytes of float32 copies of the demo model's linear layers and its tied head."""
    layers = [model.model.embed_tokens]
    for b in model.layers:
        layers += [b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj,
                   b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj]
    return 4 * sum(float32_weight(m).size for m in layers)


def stored_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.slow
def test_a_rank_keeps_float32_weights_within_its_memory(clusters, checkpoint):
    """A rank on the CPU decodes a small bfloat16 model from float32 copies of its weights, and
    counts them."""
    import mlx_lm

    path = checkpoint("bfloat16")
    model, _ = mlx_lm.load(str(path))
    cluster = clusters.get(2, path)
    assert cluster.model.weight_bytes == stored_bytes(model) + float32_bytes(model)
    assert all(r.products == {"packed": 0, "float32": 7 * len(model.layers) + 1} for r in cluster.ranks)


@pytest.mark.parametrize("form", ["q4g32", "q8g64"])
def test_a_rank_multiplies_quantized_weights_from_their_stored_bytes(checkpoint, form):
    """Every quantized layer of a 4- or 8-bit checkpoint (and its tied head) multiplies from its stored
    bytes on every rank, as the rank reports; the rank holds those bytes and no float32 copy of them
    (MLX's own count, while it answers and at its peak), and answers as mlx-lm does."""
    import mlx_lm

    path = checkpoint(form)
    model, _ = mlx_lm.load(str(path))
    stored, float32 = stored_bytes(model), float32_bytes(model)
    cluster = Cluster.launch(2)  # its own: a pooled rank's peak so far is other models'
    try:
        cluster.connect()
        cluster.load(str(path))
        assert cluster.model.weight_bytes == stored
        assert all(r.products == {"packed": 7 * len(model.layers) + 1, "float32": 0} and not r.products_note
                   for r in cluster.ranks)
        ids, _ = question_ids(path, seed=1)
        got, _, _ = run_raw(cluster, path, ids, "pass_kv", MAX_TOKENS)
        assert_within_noise(path, ids, got)
        for s in cluster.stats_once():
            # float32 copies would hold `float32` bytes more, for good; a prefill's buffers, one layer's
            assert s.mlx_active_bytes < stored + float32 // 3, (s.mlx_active_bytes, stored, float32)
            assert s.mlx_peak_bytes < stored + float32, (s.mlx_peak_bytes, stored, float32)
    finally:
        cluster.close()


@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_weight_products_run_in_float32_on_the_cpu(checkpoint, form):
    """On the CPU a rank computes a block's weight products in float32 from the stored weights (MLX's
    low-precision CPU kernels are 15-100x slower); a decode token keeps the native kernel, bit for bit,
    unless the rank keeps float32 copies of the weights, which it does only within its budget."""
    import mlx.core as mx
    import mlx_lm

    from cpchat.rank.cpu_products import MIN_ROWS, keep_float32_weights, use_float32_products

    model, _ = mlx_lm.load(str(checkpoint(form)))
    layer, head = model.layers[0].mlp.down_proj, model.model.embed_tokens
    native, native_head = type(layer), type(head)
    # q, k, v, o, gate, up, down in every layer, and the embedding as the tied output head
    assert use_float32_products(model) == 7 * len(model.layers) + 1
    x = mx.random.normal((1, MIN_ROWS, model.args.intermediate_size)).astype(mx.bfloat16)
    weight, head_weight = float32_weight(layer), float32_weight(head)
    assert mx.array_equal(layer(x), (x.astype(mx.float32) @ weight.T).astype(x.dtype)).item()
    one, hidden = x[:, :1], mx.random.normal((1, 1, model.args.hidden_size)).astype(mx.bfloat16)
    assert mx.array_equal(layer(one), native.__call__(layer, one)).item()
    assert mx.array_equal(head.as_linear(hidden), native_head.as_linear(head, hidden)).item()

    need = float32_bytes(model)
    assert keep_float32_weights(model, need - 1) == 0  # over budget: decode stays native
    assert mx.array_equal(layer(one), native.__call__(layer, one)).item()
    assert keep_float32_weights(model, need) == need
    assert mx.array_equal(layer(one), (one.astype(mx.float32) @ weight.T).astype(one.dtype)).item()
    assert mx.array_equal(head.as_linear(hidden),
                          (hidden.astype(mx.float32) @ head_weight.T).astype(hidden.dtype)).item()
    assert "_float32" not in dict(layer)  # the copy is no parameter: saved or counted, the model's weights


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_speculative_decoding_in_low_precision(clusters, checkpoint, form):
    """The demo model as mlx_lm.convert makes it, quoting its document through 2 ranks with four proposals
    a step (from lookup, and from the checkpoint as its own draft: float32 products from copies of its
    weights), exchange and gather steps: mlx-lm's tokens, within its noise, proposals kept."""
    path = checkpoint(form)
    cluster = clusters.get(2, path)
    ids, _ = question_ids(path, seed=1)
    for decode, speculate in itertools.product(("exchange", "gather"), ("lookup", f"draft:{path}")):
        cluster.reset(0)
        session = raw_session(cluster, path, "auto", MAX_TOKENS)
        session.speculate, session.draft_tokens, session.planner.decode = speculate, 4, decode
        got, events = next_turn(session, ids)
        assert_within_noise(path, ids, got)
        speculated = next(e for e in events if isinstance(e, Done)).speculation
        assert speculated.accepted > 0 and speculated.steps < len(got), speculated
