"""Small mlx-lm model directories built offline: config, seeded random
weights and a byte-level BPE tokenizer with a ChatML chat template.

Tests use these for every architecture cpchat supports; the demo model
falls back to one when no trained model ships in assets/.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """How one mlx-lm model type differs from the common llama-style config.

    `config` holds the family's own keys, with values from its published
    configs (shrunk where a size is involved); a callable value is called
    with the config built so far. `window` is the sliding window of the
    families that always have sliding layers; it is kept small so that short
    test prompts cross it.
    """

    layers: int = 2  # enough for every kind of layer the family has to appear
    rope_theta: float = 10000.0
    tie: bool = False
    max_positions: int = 1 << 17
    window: int | None = None
    offset_norms: bool = False  # norms scale by 1 + weight (Gemma)
    final_norm: str = "model.norm.weight"
    config: dict = field(default_factory=dict)
    # weight name suffix -> factor(config): undoes a fixed multiplier of the family, so
    # random weights give activations at the scale an unscaled model's would
    rescale: dict = field(default_factory=dict)


def _alternating(c: dict) -> list[str]:
    """layer_types with sliding and full layers taking turns, the last one full."""
    n = c["num_hidden_layers"]
    return ["sliding_attention" if (n - i) % 2 == 0 else "full_attention" for i in range(n)]


def _longrope_factors(c: dict) -> list[float]:
    """Phi-3/4 style per-frequency long factors: 1 for fast frequencies growing to 32 for slow ones."""
    n = int(c["head_dim"] * c["partial_rotary_factor"]) // 2
    return [round(32.0 ** (i / (n - 1)) ** 2, 4) for i in range(n)]


# Llama 3.1's rope_scaling: write_model(path, "llama", rope_scaling=LLAMA3_ROPE_SCALING).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Families whose sliding layers come from `layer_types`, which their published
# configs leave out: model_config(..., sliding_window=n) adds alternating layers.
LAYER_TYPES_SLIDING = ("llama", "mistral", "ministral3")

GATED_DELTANET = {  # linear-attention layers of Qwen3-Next and Qwen3.5, shrunk
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "ministral3": Family(  # Ministral 3 3B (2512)
        tie=True,
        max_positions=256,  # factor * original_max_position_embeddings, as in the release
        config={
            "rope_parameters": {
                "rope_type": "yarn",
                "type": "yarn",
                "rope_theta": 1e9,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                # 16384 in the release; 16 here so the llama-4 query scaling
                # 1 + beta * log(1 + floor(pos / 16)) changes within a short prompt.
                "original_max_position_embeddings": 16,
                "llama_4_scaling_beta": 0.1,
            },
        },
    ),
    "qwen2": Family(config={"attention_bias": True}),  # qwen2 always has q/k/v biases
    "qwen3": Family(),
    "qwen3_moe": Family(  # Qwen3-30B-A3B: 128 experts, top 8
        rope_theta=1e6,
        max_positions=40960,
        config={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": lambda c: c["hidden_size"] // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    "mixtral": Family(  # Mixtral-8x7B: 8 experts, top 2
        rope_theta=1e6,
        max_positions=32768,
        config={"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "phi3": Family(  # Phi-4-mini: partial rotary, longrope
        tie=True,
        max_positions=131072,
        config={
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096,
            "rope_scaling": lambda c: {
                "type": "longrope",
                "long_factor": _longrope_factors(c),
                "short_factor": [1.0] * len(_longrope_factors(c)),
            },
        },
    ),
    "glm4": Family(  # GLM-4-0414: half the head rotated, q/k/v biases, sandwich norms
        max_positions=32768,
        config={"attention_bias": True, "partial_rotary_factor": 0.5},
    ),
    "granite": Family(  # Granite 3.1 2B: muP-style multipliers
        rope_theta=1e7,
        tie=True,
        max_positions=131072,
        config={
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": lambda c: 1.0 / c["head_dim"],
            "logits_scaling": 8.0,
            "attention_bias": False,
            "mlp_bias": False,
        },
        rescale={
            "embed_tokens.weight": lambda c: 1.0 / c["embedding_multiplier"],
            "o_proj.weight": lambda c: 1.0 / c["residual_multiplier"],
            "down_proj.weight": lambda c: 1.0 / c["residual_multiplier"],
            "q_proj.weight": lambda c: c["head_dim"] ** -0.5 / c["attention_multiplier"],
        },
    ),
    "olmo2": Family(  # OLMo-2 7B: q/k norm over all heads, post-norms
        rope_theta=500000.0,
        max_positions=4096,
        config={"rms_norm_eps": 1e-6, "attention_bias": False},
    ),
    "smollm3": Family(  # SmolLM3-3B: every 4th layer has no RoPE
        layers=4,
        rope_theta=5e6,
        tie=True,
        max_positions=65536,
        config={
            "no_rope_layer_interval": 4,
            "no_rope_layers": lambda c: [int((i + 1) % 4 != 0) for i in range(c["num_hidden_layers"])],
        },
    ),
    "starcoder2": Family(  # StarCoder2-3B: LayerNorm with biases, biases everywhere, GELU
        rope_theta=999999.4420358813,
        tie=True,
        max_positions=16384,
        config={"norm_epsilon": 1e-5, "use_bias": True},
    ),
    "cohere": Family(  # Command R+: parallel attention/MLP, per-head LayerNorm on q/k, logit_scale
        rope_theta=75e6,
        tie=True,
        max_positions=131072,
        config={
            "layer_norm_eps": 1e-5,
            "layer_norm_bias": False,
            "use_qk_norm": True,
            "logit_scale": 0.8333333333333334,
        },
    ),
    "internlm3": Family(  # InternLM3-8B: dynamic NTK rope scaling
        rope_theta=5e7,
        max_positions=64,  # 32768 in the release; 64 so a ~100-token prompt goes past it
        config={"rope_scaling": {"rope_type": "dynamic", "factor": 6.0}, "bias": False, "qkv_bias": False},
    ),
    "exaone4": Family(  # EXAONE 4.0 32B: three sliding layers, then a global one without RoPE
        layers=4,
        rope_theta=1e6,
        max_positions=131072,
        window=8,
        config={
            # "LLLG" (shorter when there are fewer layers, so a global one is always there)
            "sliding_window_pattern": lambda c: "L" * (min(4, c["num_hidden_layers"]) - 1) + "G",
            "layer_types": lambda c: [  # mlx-lm reads the pattern, transformers these
                "full_attention" if (i + 1) % len(c["sliding_window_pattern"]) == 0 else "sliding_attention"
                for i in range(c["num_hidden_layers"])
            ],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "gemma3_text": Family(  # Gemma 3 4B: five sliding layers, then a global one
        layers=6,
        rope_theta=1e6,
        tie=True,  # mlx-lm ties when the checkpoint has no lm_head, as Gemma's has not
        max_positions=131072,
        window=16,
        offset_norms=True,
        config={
            "rms_norm_eps": 1e-6,
            "sliding_window_pattern": lambda c: min(6, c["num_hidden_layers"]),  # a global layer every 6th
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": lambda c: c["head_dim"],
            # Gemma 3 dropped Gemma 2's softcapping, and mlx-lm's gemma3_text reads neither key.
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
    ),
    "gpt_oss": Family(  # gpt-oss-20b: sliding and full layers alternate, attention sinks, yarn
        layers=4,
        rope_theta=150000.0,
        max_positions=131072,
        window=8,
        config={
            "layer_types": _alternating,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": lambda c: c["hidden_size"],
            "attention_bias": True,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
        },
    ),
    "qwen3_next": Family(  # Qwen3-Next: Gated DeltaNet layers, a full-attention layer every 4th
        config={
            **GATED_DELTANET,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": lambda c: c["hidden_size"] // 2,
            "mlp_only_layers": [],
            "moe_intermediate_size": lambda c: c["hidden_size"] // 2,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 2,
        },
    ),
    "qwen3_5": Family(  # Qwen3.5: Gated DeltaNet layers, a full-attention layer every 4th (text model)
        layers=4,
        final_norm="language_model.model.norm.weight",
        config={
            **GATED_DELTANET,
            "full_attention_interval": 4,
            "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    "nemotron_h": Family(  # Nemotron-H: Mamba-2 layers, attention and MLP blocks between them
        layers=4,
        final_norm="backbone.norm_f.weight",
        config={
            "hybrid_override_pattern": ["M", "*", "-", "M"],
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 2,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, float("inf")],
        },
    ),
    "deepseek_v3": Family(  # DeepSeek-V3: MLA, sigmoid-routed grouped experts after dense layers
        layers=3,
        max_positions=163840,
        config={
            "num_key_value_heads": lambda c: c["num_attention_heads"],
            "rms_norm_eps": 1e-6,
            # MLA, all widths distinct: K (nope 16 + rope 8 = 24) != V (32) != latent (64)
            "q_lora_rank": lambda c: 3 * c["hidden_size"] // 4,
            "kv_lora_rank": lambda c: c["hidden_size"],
            "qk_nope_head_dim": lambda c: c["head_dim"],
            "qk_rope_head_dim": lambda c: c["head_dim"] // 2,
            "v_head_dim": lambda c: 2 * c["head_dim"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": lambda c: c["hidden_size"] // 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_scaling": {
                "type": "yarn",
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        },
    ),
}
ARCHITECTURES = tuple(FAMILIES)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A long document is split into
chunks, and every rank holds two of them: one from the head and one from the
tail, so that causal attention costs every rank the same. Keys and values
travel around the ring while queries stay at home. The answer is 42.
What is the access code for the vault? The access code is 4812-KX.
def main():\n    print("hello, world")\n    return 0\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Names: Orion, Lyra, Vega, Altair.
"""


def train_tokenizer(
    path: Path, vocab_size: int = 512, corpus: Iterable[str] | None = None, digit_group: int = 0
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `path`; return the vocabulary size.

    `digit_group` n > 0 cuts runs of digits into pieces of at most n digits, left to right
    (2: "48125" is "48", "12", "5"): a number becomes a few tokens from a larger alphabet, so
    "the token after this one" is less ambiguous when a model copies it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digit_group:
        digits = pre_tokenizers.Split(Regex(rf"\d{{1,{digit_group}}}"), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _CORPUS.splitlines(), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": EOS_TOKEN,
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def model_config(
    arch: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
    tie_embeddings: bool | None = None,
    rope_theta: float | None = None,
    sliding_window: int | None = None,
    rope_scaling: dict | None = None,
    overrides: dict | None = None,
) -> dict:
    """The config.json of a small `arch` model; None picks the family's default.

    `sliding_window` sets the window of the families that always slide, and gives
    llama, mistral and ministral3 alternating sliding and full layers (4 unless
    `num_layers` says otherwise). `rope_scaling` replaces the family's (for
    example LLAMA3_ROPE_SCALING). `overrides` replace any keys last (a family's layer pattern, say).
    """
    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    family = FAMILIES[arch]
    window = sliding_window or family.window
    if window and family.window is None and arch not in LAYER_TYPES_SLIDING:
        raise ValueError(f"{arch} has no sliding-window attention in mlx-lm")
    if num_layers is None:
        num_layers = 4 if window and family.window is None else family.layers
    config = {
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings or family.max_positions,
        "rope_theta": rope_theta or family.rope_theta,
        "tie_word_embeddings": family.tie if tie_embeddings is None else tie_embeddings,
    }
    for key, value in family.config.items():
        config[key] = value(config) if callable(value) else value
    if window:
        config["sliding_window"] = window
        if family.window is None:
            config["layer_types"] = _alternating(config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return {**config, **(overrides or {})}


def write_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    weight_scale: float = 4.0,
    dtype: str = "float32",
    **options,
) -> Path:
    """Build an mlx-lm model directory with seeded random weights; `options` go to model_config.

    `weight_scale` multiplies the final norm (divided by the family's own logit
    multiplier, such as granite's 1 / logits_scaling) so random logits are
    peaked, which keeps greedy decoding clear of near-ties. Biases get small
    random values, attention sinks random ones, and weights the model class
    starts at zero (router weights, cohere's q/k LayerNorm) a neutral random
    or unit value, so no part of the model is inert.
    """
    from mlx_lm.utils import _get_classes

    path = Path(path)
    vocab = train_tokenizer(path, vocab_size)
    config = model_config(arch, vocab, **options)
    config["eos_token_id"] = vocab_size_index(path, EOS_TOKEN)
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):  # whose configs stay as they were
        # transformers' config classes would otherwise warn about their defaults' ids
        config.update(bos_token_id=None, pad_token_id=vocab_size_index(path, "<|endoftext|>"))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    family = FAMILIES[arch]
    if family.final_norm not in weights:
        raise ValueError(f"{arch}: no final norm {family.final_norm} to scale")
    factors = {suffix: f(config) for suffix, f in family.rescale.items()}
    final_scale = weight_scale / _logit_multiplier(config)
    if config["tie_word_embeddings"]:
        final_scale /= factors.get("embed_tokens.weight", 1.0)  # the head shares the rescaled embeddings
    for name, w in weights.items():
        if factor := next((f for suffix, f in factors.items() if name.endswith(suffix)), None):
            weights[name] = w * factor
        elif name == family.final_norm:
            if config["tie_word_embeddings"]:
                # A tied head scores the current token's own embedding highest; random signs
                # in the final norm stop greedy decoding from repeating it forever.
                w = w * mx.random.normal(w.shape)
            weights[name] = (1.0 + w) * final_scale - 1.0 if family.offset_norms else w * final_scale
        elif name.endswith("bias"):
            weights[name] = mx.random.normal(w.shape) * 0.1
        elif name.endswith("sinks"):
            weights[name] = mx.random.normal(w.shape)
        elif not mx.any(w).item():  # router weights, cohere's q/k LayerNorm
            if "norm" in name:
                weights[name] = mx.ones(w.shape)
            else:
                weights[name] = mx.random.normal(w.shape) * w.shape[-1] ** -0.5
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)  # mlx-lm's gemma3_text ties only when there is none
    weights = tree_map(lambda w: w.astype(getattr(mx, dtype)), weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _logit_multiplier(config: dict) -> float:
    """What the model multiplies its logits by after the head (cohere, granite)."""
    return config.get("logit_scale", 1.0) / config.get("logits_scaling", 1.0)


def vocab_size_index(path: Path, token: str) -> int:
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in vocab if t["content"] == token)


def convert_model(source: Path, path: Path, form: str) -> Path:
    """A checkpoint in one of the forms people download, made with mlx_lm.convert as they are:
    "bfloat16" / "float16" from `source`, or "q4g64" (bits, group size) quantized from a bfloat16
    copy (kept beside `path`), as published 4-bit models are quantized from bfloat16 weights."""
    from mlx_lm import convert

    if form in ("bfloat16", "float16"):
        convert(str(source), str(path), dtype=form)
        return path
    bits, group = (int(x) for x in form[1:].split("g"))
    bf16 = path.parent / f"{path.name}-bfloat16"
    if not bf16.exists():
        convert(str(source), str(bf16), dtype="bfloat16")
    convert(str(bf16), str(path), quantize=True, q_bits=bits, q_group_size=group)
    return path
