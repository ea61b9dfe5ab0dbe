"""`cpchat plan --paper HOSTS`: a model planned over hosts that are not here, from its shapes alone —
weights read from mlx-lm's lazily built model equal the files' own bytes, K/V counted by hand, and a
70B 4-bit model at 128K over eight hosts as the issue asks it."""

import json
import shutil

import pytest
from helpers import one_line_error, run

from cpchat.client.models import weight_parts
from cpchat.client.paper import paper_model, parse_hosts
from cpchat.core.paper_plan import LayerKV, PaperModel, paper_plan
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.core.stages import Stages, WeightParts
from cpchat.errors import BadInput
from cpchat.smallmodels import write_model

GIB = 2**30

# Llama 3.1 70B's config.json, quantized as mlx-community's 4-bit conversions are.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "quantization": {"group_size": 64, "bits": 4},
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def config_only(model, tmp_path):
    """The model's directory with its config.json alone: what a plan on paper reads."""
    bare = tmp_path / f"{model.name}-config"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    return bare


@pytest.mark.parametrize("form", ["float32", "q4g64"])
def test_weights_from_the_config_alone_equal_the_files(form, model_dir, checkpoint, tmp_path):
    """The lazily built model's bytes, part by part, are the safetensors files' (float32, and a 4-bit
    checkpoint quantized by mlx_lm.convert)."""
    model = model_dir("llama") if form == "float32" else checkpoint(form)
    on_paper = paper_model(config_only(model, tmp_path), FULL_PRECISION).weights
    assert on_paper == weight_parts(model) and sum(on_paper.layers) > 0


def test_kv_a_token_by_hand_with_windows_and_states(tmp_path):
    """llama with alternating sliding layers: 2 x kv heads x head dim x 4 bytes a layer, the sliding
    ones keeping their window; 8-bit K/V packed as mlx-lm packs them; a hybrid's linear layers none."""
    path = write_model(tmp_path / "slide", "llama", sliding_window=32, num_layers=4)
    config = json.loads((path / "config.json").read_text())
    model = paper_model(path, FULL_PRECISION)
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    windows = [32 if kind == "sliding_attention" else 0 for kind in config["layer_types"]]
    assert [(kv.bytes_per_token, kv.window) for kv in model.kv] == [(per_token, w) for w in windows]
    assert 0 in windows and 32 in windows
    packed = paper_model(path, KVFormat(8, 64)).kv[0].bytes_per_token
    assert packed == 2 * config["num_key_value_heads"] * config["head_dim"] * (1 + 2 * 4 / 64)
    hybrid = paper_model(write_model(tmp_path / "hybrid", "qwen3_next", num_layers=4), FULL_PRECISION)
    assert 0 < sum(kv.bytes_per_token == 0 for kv in hybrid.kv) < 4


def test_a_70b_model_at_128k_over_eight_hosts(tmp_path):
    """The weights worked out by hand (4 bits and a bfloat16 scale and bias a group of 64; bfloat16
    norms); 16K tokens a host at one stage; at 32 GiB a host, auto takes two stages; at 8 GiB even
    eight stages of one host (10 layers, all 128K tokens' K/V) do not hold."""
    path = tmp_path / "llama-70b-4bit"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_70B))
    h, f, kv, vocab, layers = 8192, 28672, 8 * 128, 128256, 80
    quantized = (2 * h * h + 2 * h * kv + 3 * h * f) * layers + 2 * vocab * h
    weights = quantized * (0.5 + 4 / 64) + (2 * layers + 1) * h * 2
    model = paper_model(path, FULL_PRECISION)
    assert model.weights.stage_bytes(0, 80, 0, 1) == weights
    plan = paper_plan(model, parse_hosts("8x64G"), 128 * 1024, Stages(auto=True))
    assert plan.stages == 1 and plan.holds
    assert {(h.tokens, h.kv_bytes) for h in plan.hosts} == {(16384, 16384 * layers * 2 * kv * 2)}  # 5 GiB
    two = paper_plan(model, parse_hosts("8x32G"), 128 * 1024, Stages(auto=True))
    assert two.stages == 2 and two.holds and [h.layers for h in two.hosts[3:5]] == [(0, 40), (40, 80)]
    assert not paper_plan(model, parse_hosts("8x8G"), 128 * 1024, Stages(auto=True)).holds  # 8 x 1 the most

    printed = run(["plan", "--model", str(path), "--context", "128K", "--paper", "8x64G"])
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert lines[0].endswith("on paper: 131,072 tokens on 8 hosts, 1 stage x 8 context ranks, equal shares")
    assert lines[1] == ("host 0: stage 0, layers 0-79, 16,384 tokens, weights 37 GiB, K/V 5.0 GiB: "
                        "42 GiB of 64 GiB")
    assert lines[-1].startswith("holds on every host")
    short = run(["plan", "--model", str(path), "--context", "128K", "--paper", "8x8G", "--stages", "auto"])
    assert short.returncode == 1 and short.stdout.splitlines()[-1].startswith("does not hold")
    plan = ["plan", "--model", str(path), "--context", "1K", "--paper"]
    one_line_error(run([*plan, "eight"]), 2, "--paper 'eight'")
    one_line_error(run([*plan, "8x64G", "--stages", "3"]), 2,
                   "--stages does not split the model's 80 layers over 8 hosts")


def test_hosts_parse_as_a_count_of_one_size_or_each_size():
    assert parse_hosts("8x64G") == [64 * GIB] * 8
    assert parse_hosts("64G,64G,32G") == [64 * GIB, 64 * GIB, 32 * GIB]
    for bad in ("", "x64G", "8x", "64Q", "0x64G"):
        with pytest.raises(BadInput):
            parse_hosts(bad)


def test_stages_the_model_or_the_hosts_cannot_take_are_none():
    model = PaperModel(WeightParts([10, 10], 5, 5, tied=False), [LayerKV(8), LayerKV(8)])
    assert paper_plan(model, [GIB] * 4, 100, Stages(4)) is None  # more stages than layers
    assert paper_plan(model, [GIB] * 3, 100, Stages(2)) is None  # 3 hosts in 2 stages
    assert paper_plan(model, [GIB] * 2, 100, Stages(2, (1, 2))) is None  # 3 layers given, 2 there
    plan = paper_plan(model, [GIB] * 4, 100, Stages(2, (1, 1)))
    assert [h.weight_bytes for h in plan.hosts] == [15] * 4 and [h.tokens for h in plan.hosts] == [50] * 4
