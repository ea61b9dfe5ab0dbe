"""mlx-lm's catalogue through real ranks: every model type whose attention is softmax attention
over RoPE'd keys runs exactly as mlx-lm's own single-process generation (tokens, and logprobs
within 1e-3), through 2 ranks with pass-KV, 3 with pass-Q and all-gather and 4 with Ulysses, with
prompts long enough to cross the sliding windows; what does not fit is refused by name with the reason."""

import pytest
from helpers import VARIANTS, assert_same, next_turn, random_prompt, raw_session, run_raw
from references import reference_generate

from cpchat.errors import BadInput
from cpchat.smallmodels import write_model

REFUSED = {  # name -> (model type, options, what the refusal says)
    "mamba-only": ("nemotron_h", {"overrides": {"hybrid_override_pattern": ["M", "-"]}}, "no layer attends"),
}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    built = {}

    def get(name: str):
        if name not in built:
            arch, options = VARIANTS[name] if name in VARIANTS else REFUSED[name][:2]
            built[name] = write_model(root / name, arch, **options)
        return built[name]

    return get


@pytest.mark.parametrize("ranks, algorithm", [  # two ranks in the fast tier, every count in the whole suite
    pytest.param(1, "pass_kv", marks=pytest.mark.slow), (2, "pass_kv"),
    *(pytest.param(n, a, marks=pytest.mark.slow) for n, a in ((3, "pass_q"), (3, "all_gather"),
                                                               (4, "ulysses")))])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_architecture_matches_mlx_lm(clusters, variant_dir, name, ranks, algorithm):
    path = variant_dir(name)
    cluster = clusters.get(ranks, path)
    for length in (1, 37):
        ids = random_prompt(path, length, seed=length)
        cluster.reset(0)
        got, _, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS)
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_attention_is_refused_by_name(clusters, variant_dir, name):
    arch, _, says = REFUSED[name]
    cluster = clusters.get(2, variant_dir("llama"))
    with pytest.raises(BadInput, match=says) as refusal:
        cluster.load(str(variant_dir(name)))
    assert arch in str(refusal.value) and "\n" not in str(refusal.value)
    clusters.loaded.pop((2, "auto"))  # the ranks keep the old model; reload it for the next test


def test_a_mask_made_by_the_model_is_refused():
    """cpchat's caches make no masks, so an array mask carries the model's own scores (as MLA's RoPE
    scores did before cpchat had a latent-attention path): attention refuses it instead of ignoring it."""
    import threading

    import mlx.core as mx
    import numpy as np

    from cpchat.rank.algorithms import ATTEND
    from cpchat.rank.context_parallel import RingPass, ShardCache, ring_attention
    from cpchat.rank.fit import UnsupportedModel
    from cpchat.rank.kvstore import KVShard
    from cpchat.rank.transport.ring import Mailbox, Ring

    ring_pass = RingPass("r", "pass_kv", Ring(0, 1, {}, Mailbox(lambda f, n: None)), KVShard(1), 0,
                         np.arange(2), np.ones(2, bool), True, threading.Event(), windows=[None],
                         crossing=ATTEND["pass_kv"])
    q = mx.zeros((1, 2, 2, 8))
    attention = ring_attention(lambda *a, **k: None)
    with pytest.raises(UnsupportedModel, match="layer 0 passes attention a mask of its own"):
        attention(q, q, q, ShardCache(ring_pass, 0), 1.0, mask=mx.zeros((2, 2)))


def test_length_dependent_rope_is_served_up_to_its_exact_length(clusters, variant_dir):
    """internlm3's dynamic-NTK RoPE rescales past max_position_embeddings (64 in the tiny model) with
    the length of the block being rotated, so mlx-lm's own answer there depends on how it cuts the
    prompt: within it cpchat matches mlx-lm (test above), past it the request is refused, saying why."""
    path = variant_dir("internlm3")
    cluster = clusters.get(2, path)
    with pytest.raises(BadInput, match="serves it up to 64 tokens"):
        run_raw(cluster, path, random_prompt(path, 60, seed=1), "pass_kv", MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_sliding_layers_forget_old_keys_and_turns_stay_exact(clusters, variant_dir, name):
    """Sliding-window layers drop the keys no later query can see: three turns through 3 ranks hold
    less K/V than full layers would, and still equal mlx-lm over the whole history; a turn that
    would keep fewer tokens than the windows allow re-prefills everything, and is exact too."""
    path = variant_dir(name)
    cluster = clusters.get(3, path)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    history: list[int] = []
    turns = zip((90, 30, 7), ("ulysses", "all_gather", "auto"), strict=True)
    for turn, (length, algorithm) in enumerate(turns):
        session.planner.algorithm = algorithm
        new = random_prompt(path, length, seed=300 + turn)
        got, events = next_turn(session, new)
        history += new
        assert_same(got, reference_generate(path, history, MAX_TOKENS))
        history += [t for t, _ in got]
        done = events[-1]
        assert session.held.keep_floor == len(history) - len(got)  # the end of this turn's prompt
    full = full_kv_bytes(cluster, path, len(history))
    assert sum(r.kv_bytes for r in done.ranks) < 0.6 * full
    # Keep fewer tokens than the windows allow (as when a chat template rewrites the last answer):
    shorter = history[: session.held.keep_floor - 3] + random_prompt(path, 5, seed=9)
    events = list(session.generate(shorter))
    assert next(e for e in events if type(e).__name__ == "Prefill").cached_tokens == 0
    assert_same([(e.id, e.logprob) for e in events if hasattr(e, "logprob")],
                reference_generate(path, shorter, MAX_TOKENS))


def full_kv_bytes(cluster, path, tokens: int) -> int:
    """What every layer holding every token's K/V would take."""
    import json

    config = json.loads((path / "config.json").read_text())
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * cluster.model.num_layers
    return tokens * per_token
