import json

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from cpchat.families import ARCHITECTURES
from cpchat.smallmodels import write_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_small_models_load_and_generate(model_dir, arch):
    path = model_dir(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    tokens = [
        r.token
        for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12, sampler=make_sampler(0.0))
    ]
    assert len(tokens) >= 1
    assert len(set(tokens)) > 1 or len(tokens) < 12  # peaked but not degenerate


def test_same_seed_same_weights(tmp_path):
    a = write_model(tmp_path / "a", "qwen3", seed=5)
    b = write_model(tmp_path / "b", "qwen3", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_qwen2_has_attention_bias_and_qwen3_has_qk_norm(model_dir):
    import mlx.core as mx

    q2 = mx.load(str(model_dir("qwen2") / "model.safetensors"))
    q3 = mx.load(str(model_dir("qwen3") / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in q2
    assert "model.layers.0.self_attn.q_norm.weight" in q3


def test_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture"):
        write_model(tmp_path / "x", "gpt5")
