"""An mlx-lm `config.json` from a GGUF file's metadata.

llama.cpp's converter writes each Hugging Face config value under `<architecture>.<key>`; this
module reads them back for the architectures cpchat converts. Mistral checkpoints are written as
`llama`. What the metadata cannot express in mlx-lm's terms is refused by name.
"""

from __future__ import annotations

import numpy as np

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_file import GGUFFile

# GGUF architecture -> mlx-lm model_type
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# Gemma 3's constants, which llama.cpp keeps in code rather than in the file when it is not told them
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def mlx_config(f: GGUFFile) -> dict:
    arch = f.architecture
    if arch not in MODEL_TYPES:
        raise CheckpointError(f"{f.path.name}: architecture {arch or '(none)'!r} is not one cpchat converts "
                              f"from GGUF (it converts {', '.join(MODEL_TYPES)}; mistral is written as "
                              "llama)")
    heads = _count(f, "attention.head_count")
    kv_heads = _count(f, "attention.head_count_kv", heads)
    hidden = _count(f, "embedding_length")
    head_dim = _count(f, "attention.key_length", hidden // heads)
    if _count(f, "attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{f.path.name}: keys and values of different sizes are not supported")
    rotary = _count(f, "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise CheckpointError(f"{f.path.name}: RoPE over {rotary} of {head_dim} head dimensions "
                              "(partial rotary) is not supported for this architecture")
    embedding = f.tensors["token_embd.weight"]
    config = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": _count(f, "block_count"),
        "intermediate_size": _count(f, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": embedding.shape[0],
        "max_position_embeddings": _count(f, "context_length"),
        "rope_theta": float(f.get("rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    if arch == "gemma3":
        config["sliding_window"] = _count(f, "attention.sliding_window")
        config["sliding_window_pattern"] = _count(f, "attention.sliding_window_pattern",
                                                  GEMMA3_SLIDING_PATTERN)
        config["rope_local_base_freq"] = float(f.get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        # llama.cpp: the 27B model scales queries by its hidden size per head, the others by the head size
        config["query_pre_attn_scalar"] = hidden // heads if _count(f, "block_count") == 62 else head_dim
    if scaling := rope_scaling(f, head_dim, config["rope_theta"]):
        config["rope_scaling"] = scaling
    return config


def _count(f: GGUFFile, key: str, default: int | None = None) -> int:
    value = f.get(key, default)
    if value is None:
        raise CheckpointError(f"{f.path.name}: the metadata lacks {f.architecture}.{key}")
    if isinstance(value, np.ndarray):  # a per-layer list: only a constant one fits mlx-lm's config
        if value.size == 0 or (value != value.flat[0]).any():
            raise CheckpointError(f"{f.path.name}: {f.architecture}.{key} differs between layers, which "
                                  "cpchat does not convert")
        value = value.flat[0]
    return int(value)


def rope_scaling(f: GGUFFile, head_dim: int, base: float) -> dict | None:
    """mlx-lm's rope_scaling: from the `rope.scaling.*` keys, or Llama 3's per-frequency factors, which
    llama.cpp stores as the tensor `rope_freqs.weight`."""
    kind = str(f.get("rope.scaling.type", "none"))
    factor = float(f.get("rope.scaling.factor", 1.0))
    original = f.get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in f.tensors:
        factors = f.raw(f.tensors["rope_freqs.weight"]).view(np.float32).ravel()
        return llama3_scaling(factors, head_dim, base, int(original or 8192), f.path.name)
    if kind in ("none", "") or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            if (value := f.get(f"rope.scaling.yarn_{key}")) is not None:
                scaling[key] = float(value)
        return scaling
    raise CheckpointError(f"{f.path.name}: RoPE scaling {kind!r} is not supported")


def llama3_scaling(factors: np.ndarray, head_dim: int, base: float, original: int, name: str) -> dict:
    """Llama 3's scaling parameters from its per-frequency factors f_i (what the period of pair i is
    multiplied by): 1 for fast frequencies, `factor` for slow ones, and between them
    1/f = (1 - s)/factor + s with s = original/wavelength/(high - low) - low/(high - low), a line in
    1/wavelength whose slope and intercept give the two frequency factors."""
    periods = base ** (np.arange(0, head_dim, 2) / head_dim)
    inverse_wavelength = 1 / (2 * np.pi * periods)
    factor = float(factors.max())
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0  # Llama 3.1's, when too few frequencies lie between to fit the line
    if factor > 1 and between.sum() >= 2:
        s = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inverse_wavelength[between], s, 1)
        span = original / slope
        low = float(-intercept * span)
        high = low + span
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(low, 6),
               "high_freq_factor": round(high, 6), "original_max_position_embeddings": original}
    if not np.allclose(llama3_factors(scaling, head_dim, base), factors, rtol=1e-4):
        raise CheckpointError(f"{name}: its rope_freqs are not Llama 3's scaling, which is the one "
                              "cpchat converts")
    return scaling


def llama3_factors(scaling: dict, head_dim: int, base: float) -> np.ndarray:
    """The per-frequency factors Llama 3's scaling gives (llama.cpp's rope_freqs, mlx-lm's Llama3RoPE)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelength - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, between))
