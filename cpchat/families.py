"""The architectures small test models are built in (cpchat.smallmodels): how each mlx-lm model type's
config differs from the common llama-style one, with values from its published configs, shrunk."""

from __future__ import annotations

from dataclasses import dataclass, field


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


def alternating_layers(c: dict) -> list[str]:
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
            "layer_types": alternating_layers,
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
