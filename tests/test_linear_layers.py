"""Hybrid models with linear-attention or state-space layers (Qwen3-Next and Qwen3.5's Gated
DeltaNet, Nemotron-H's Mamba-2) through real ranks: each rank runs its chunks of the sequence from
a stacked zero-and-identity state, the chunks' transforms are all-gathered and folded, convolution halos
cross between ranks, and the answer is mlx-lm's own (tokens, and logprobs within 1e-3), for 1 to 4
ranks, prompts of 1 token, of lengths that 2N does not divide, and of ~2K tokens, over several turns."""

import functools

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    assert_as_mlx_lm_up_to_a_tie,
    assert_same,
    done_event,
    next_turn,
    prefill_event,
    random_prompt,
    raw_session,
    run_raw,
)
from references import low_precision_noise, reference_generate

from cpchat.core.gated_delta import chunked_gated_delta
from cpchat.core.recurrence import add_start_state, fold
from cpchat.errors import BadInput
from cpchat.rank.fit import mix_in
from cpchat.rank.linear_layers import RECURRENCES, ShiftedConv, chunk_transform, chunked_gated_delta_update
from cpchat.smallmodels import convert_model

HYBRIDS = ("qwen3_next", "qwen3_5", "nemotron_h")
MAX_TOKENS = 6


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_matches_mlx_lm(clusters, model_dir, arch, ranks):
    """Every rank count, a prompt of one token (most ranks hold only padding), one that 2N does not
    divide, and one whose chunks are longer than the convolution's halo."""
    path = model_dir(arch)
    cluster = clusters.get(ranks, path)
    for length in (1, 2 * ranks + 1, 37):
        ids = random_prompt(path, length, seed=length)
        cluster.reset(0)
        got, events, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    assert "linear" in prefill_event(events).linear_layers
    assert len({r.state_bytes for r in done_event(events).ranks}) == 1  # the same state on every rank
    assert done_event(events).ranks[0].state_bytes > 0
    if ranks > 1:  # every rank advances the states with every token: the decode step runs everywhere
        assert {s.algorithm for s in cluster.stats_once()} <= {"decode_exchange", "decode_ring"}
        session = raw_session(cluster, path, "auto", MAX_TOKENS)
        for alone in ("lead", "gather"):
            session.planner.decode = alone
            with pytest.raises(BadInput, match=f"linear layers keep a state .* a {alone} decode step"):
                next_turn(session, ids)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_a_long_prompt_through_four_ranks(clusters, model_dir, arch):
    path = model_dir(arch)
    cluster = clusters.get(4, path)
    ids = random_prompt(path, 2000, seed=5)
    got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
    assert_same(got, reference_generate(path, ids, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_turns_go_on_from_the_stored_state(clusters, model_dir, arch):
    """Three turns through 3 ranks: each later turn prefills only its new tokens, from the state the
    ranks kept, and equals mlx-lm over the whole history. A turn that rewrites the last answer goes back
    to the state at the end of the last prompt (where the ranks kept one), and is exact too."""
    path = model_dir(arch)
    cluster = clusters.get(3, path)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    history: list[int] = []
    for turn, (length, algorithm) in enumerate(zip((40, 9, 1), ("pass_kv", "ulysses", "auto"), strict=True)):
        session.planner.algorithm = algorithm
        new = random_prompt(path, length, seed=400 + turn)
        got, events = next_turn(session, new)
        assert prefill_event(events).cached_tokens == max(len(history) - 1, 0)  # not the last answer token
        history += new
        assert_same(got, reference_generate(path, history, MAX_TOKENS))
        prompt_end = len(history)
        history += [t for t, _ in got]
    assert prompt_end in session.held.state_positions
    rewritten = history[: prompt_end + 2] + random_prompt(path, 4, seed=9)
    events = list(session.generate(rewritten))
    assert prefill_event(events).cached_tokens == prompt_end
    assert_same([(e.id, e.logprob) for e in events if hasattr(e, "logprob")],
                reference_generate(path, rewritten, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])  # qwen3_next: MLX's CPU has float32 experts only
def test_low_precision_hybrids(clusters, model_dir, tmp_path_factory, arch, form):
    """Converted with mlx_lm.convert as people get them: greedy tokens identical to mlx-lm on the same
    checkpoint up to a tie at the checkpoint's precision (helpers.assert_as_mlx_lm_up_to_a_tie: these
    random weights meet one), logprobs within 1.5x of mlx-lm's own low-precision noise, through 2 and 3
    ranks."""
    path = convert_model(model_dir(arch), tmp_path_factory.mktemp("converted") / form, form)
    ids = random_prompt(path, 45, seed=3)
    expected = reference_generate(path, ids, MAX_TOKENS)
    noise = low_precision_noise(path, ids, expected)
    for ranks in (2, 3):
        got, _, _ = run_raw(clusters.get(ranks, path), path, ids, "auto", MAX_TOKENS)
        assert_as_mlx_lm_up_to_a_tie(path, ids, got, expected, noise)


def _original(name: str):
    from mlx_lm.models import gated_delta, ssm

    return getattr(gated_delta if name == "gated_delta_update" else ssm, name)


def _normal(rng, *shape, scale=1.0):
    return mx.array(rng.normal(size=shape).astype(np.float32) * scale)


def _recurrence_args(name: str, t: int, heads: int = 4, seed: int = 0) -> tuple[dict, mx.array]:
    """Random arguments for mlx-lm's `name` over `t` tokens (keys 8 wide, values 6), and a start state."""
    rng = np.random.default_rng(seed)
    normal = functools.partial(_normal, rng)
    if name == "gated_delta_update":
        args = dict(q=normal(1, t, 2, 8, scale=0.3), k=normal(1, t, 2, 8, scale=0.3),
                    v=normal(1, t, heads, 6), a=normal(1, t, heads), b=normal(1, t, heads),
                    A_log=normal(heads, scale=0.5), dt_bias=normal(heads))
    else:
        args = dict(hidden_states=normal(1, t, heads, 6), A_log=normal(heads, scale=0.5),
                    B=normal(1, t, 2, 8), C=normal(1, t, 2, 8), D=normal(heads), dt=normal(1, t, heads),
                    dt_bias=normal(heads))
    return args, normal(1, heads, 6, 8)


@pytest.mark.parametrize("name, stand_in", [("gated_delta_update", False), ("gated_delta_update", True),
                                            ("ssm_update", False)])
def test_chunk_transforms_fold_to_the_whole_sequence(name, stand_in):
    """The math the ranks rely on: chunks run on the stacked state (chunk_transform, with mlx-lm's own
    recurrence or the ranks' prefill stand-in), folded in order from a nonzero start state, give mlx-lm's
    whole run's outputs and final state."""
    spec, original = RECURRENCES[name], _original(name)
    runner = spec.prefill if stand_in else original
    args, start = _recurrence_args(name, 23)
    whole_y, whole_state = original(**args, state=start)
    transforms, runs = [], []
    for lo, hi in zip([0, 5, 6, 17], [5, 6, 17, 23]):
        chunk = {k: (v[:, lo:hi] if isinstance(v, mx.array) and v.ndim >= 2 and v.shape[1] == 23 else v)
                 for k, v in args.items()}
        y0, r, p, q = chunk_transform(runner, spec, chunk, first=False)
        transforms.append((p, q))
        runs.append((y0, r))
    starts, state = fold(start, transforms)
    y = mx.concatenate([add_start_state(y0, r, s) for (y0, r), s in zip(runs, starts)], axis=1)
    assert np.allclose(np.asarray(y), np.asarray(whole_y), atol=1e-4)
    assert np.allclose(np.asarray(state), np.asarray(whole_state), atol=1e-4)
    assert not np.allclose(np.asarray(start), np.asarray(whole_state), atol=1e-2)  # the state moved


@pytest.mark.parametrize("length, chunk", [(1, 64), (37, 16), (64, 64), (200, 64), (130, 32)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunkwise_gated_delta_is_the_token_loop(length, chunk, with_state):
    """The chunkwise form equals mlx-lm's token-by-token loop (GQA heads, partial last chunk, strong and
    weak gates), from zero and from a given state."""
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops

    rng = np.random.default_rng(length)
    normal = functools.partial(_normal, rng)
    q, k = normal(1, length, 2, 16), normal(1, length, 2, 16)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # as normalize_qk leaves them
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) / 4
    v = normal(1, length, 4, 8)
    g = compute_g(normal(4), normal(1, length, 4, scale=3.0), normal(4))
    beta = mx.sigmoid(normal(1, length, 4))
    start = normal(1, 4, 8, 16) if with_state else None
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, start)
    y, state = chunked_gated_delta(q, k, v, g, beta, start, chunk=chunk)
    assert y.shape == want_y.shape and state.shape == want_state.shape
    assert np.allclose(np.asarray(y), np.asarray(want_y), atol=1e-5)
    assert np.allclose(np.asarray(state), np.asarray(want_state), atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"lower_bound": -2.0}, {"allow_neg_eigval": True}])
def test_prefill_stand_in_takes_mlx_lm_arguments(options):
    """chunked_gated_delta_update makes the gate and write strength as gated_delta_update does, for every
    option the models pass, and bfloat16 inputs give a bfloat16 output."""
    args, start = _recurrence_args("gated_delta_update", 70)
    args = {k: v.astype(mx.bfloat16) if k in ("q", "k", "v", "a", "b") else v for k, v in args.items()}
    want_y, want_state = _original("gated_delta_update")(**args, state=start, **options)
    y, state = chunked_gated_delta_update(**args, state=start, **options)
    assert y.dtype == want_y.dtype == mx.bfloat16
    assert np.allclose(np.asarray(y.astype(mx.float32)), np.asarray(want_y.astype(mx.float32)), atol=2e-2)
    assert np.allclose(np.asarray(state), np.asarray(want_state), atol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("padding, bias", [(0, False), (3, True)])
def test_shifted_convolution_is_the_depthwise_convolution(dtype, padding, bias):
    """A depthwise Conv1d with ShiftedConv mixed in gives what MLX's grouped convolution gives."""
    import mlx.nn as nn

    conv = nn.Conv1d(48, 48, 4, padding=padding, groups=48, bias=bias)
    if bias:
        conv.bias = mx.random.normal((48,))
    conv.set_dtype(dtype)
    x = mx.random.normal((2, 19, 48)).astype(dtype)
    want = conv(x)
    mix_in(conv, ShiftedConv)
    got = conv(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.allclose(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)),
                       atol=1e-5 if dtype == mx.float32 else 1e-2)
