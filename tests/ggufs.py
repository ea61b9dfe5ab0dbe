"""GGUF files written from small mlx-lm model directories the way llama.cpp's converter writes them
(convert_hf_to_gguf.py): its tensor names, q/k rows interleaved per head for llama's RoPE, Gemma's
norms stored as 1 + w, Llama 3's RoPE scaling as per-frequency factors, the vocabulary and merges
of the tokenizer.json with the pre-tokenizer named, the chat template; weights quantized with the
`gguf` package (llama.cpp's own Python package)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from cpchat.checkpoints.gguf_config import llama3_factors

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3_text": "gemma3"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_LAYER_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str, arch: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
    return f"blk.{layer}.{names[rest]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of a head's q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_foreign_gguf(path: Path, arch: str = "bert") -> Path:
    """A GGUF of an architecture cpchat does not convert: one tensor, no metadata of its own."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf(model: Path, out: Path, ggml_type: str | dict[str, str] = "F32", pre: str = "gpt-2",
               metadata: dict | None = None) -> Path:
    """`model` (a float32 mlx-lm directory) as a GGUF file with its matrices in `ggml_type`: one type,
    or one per GGUF name prefix ("token_embd", "attn", "ffn", "output"; F32 where none matches)."""
    config = json.loads((model / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    stored = mx.load(str(model / "model.safetensors"))
    weights = {k: np.array(v.astype(mx.float32)) for k, v in stored.items()}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        factors = llama3_factors(scaling, head_dim, config["rope_theta"])
        weights["rope_freqs.weight"] = factors.astype(np.float32)
    elif scaling:
        w.add_string(f"{arch}.rope.scaling.type", scaling.get("rope_type") or scaling["type"])
        w.add_rope_scaling_factor(scaling["factor"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
        w.add_uint32("gemma3.attention.sliding_window_pattern", config["sliding_window_pattern"])
    for key, value in (metadata or {}).items():
        _add(w, key, value)
    add_tokenizer(w, model, pre)
    for name, value in weights.items():
        if name == "rope_freqs.weight":
            w.add_tensor(name, value)
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = permute(value, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = permute(value, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1
        target = gguf_name(name, arch)
        quant = T[type_of(target, ggml_type)] if value.ndim == 2 else T.F32
        w.add_tensor(target, gguf.quants.quantize(value, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def type_of(name: str, ggml_type: str | dict[str, str]) -> str:
    if isinstance(ggml_type, str):
        return ggml_type
    short = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
    return next((t for prefix, t in ggml_type.items() if short.startswith(prefix)), "F32")


def add_tokenizer(w: gguf.GGUFWriter, model: Path, pre: str) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp writes a `gpt2` vocabulary."""
    spec = json.loads((model / "tokenizer.json").read_text())
    settings = json.loads((model / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if vocab[t] in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_eos_token_id(vocab[settings["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(settings["chat_template"])


def _add(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, str(value))


def write_vocabulary(out: Path, fields: dict, vocab_size: int, arch: str = "llama") -> Path:
    """A GGUF that is only a vocabulary (tokenizer.ggml.* `fields`) and an embedding of its size."""
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in (("block_count", 1), ("context_length", 512), ("embedding_length", 8),
                       ("feed_forward_length", 8), ("attention.head_count", 1), ("rope.dimension_count", 8)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in fields.items():
        if isinstance(value, list):
            w.add_array(f"tokenizer.ggml.{key}", value)
        else:
            _add(w, f"tokenizer.ggml.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def sentencepiece_fields(model, user_defined: list[str]) -> dict:
    """A SentencePiece model's vocabulary as llama.cpp's converter writes it (`llama` tokenizer)."""
    tokens = [model.id_to_piece(i) for i in range(model.get_piece_size())]

    def kind(i: int) -> int:  # llama.cpp's token types
        checks = (model.is_unknown, model.is_control, lambda i: tokens[i] in user_defined, model.is_unused,
                  model.is_byte)
        return next((k for k, check in zip((2, 3, 4, 5, 6), checks) if check(i)), 1)

    return {"model": "llama", "tokens": tokens, "scores": [model.get_score(i) for i in range(len(tokens))],
            "token_type": [kind(i) for i in range(len(tokens))], "bos_token_id": model.bos_id(),
            "eos_token_id": model.eos_id(), "unknown_token_id": model.unk_id()}


# Where each K-quant block keeps its float16 super-block scale (and minimum); every other byte may be
# anything, so random bytes with sane float16 there are valid blocks.
FLOAT16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82),
                  T.IQ4_NL: (0,)}


def random_blocks(kind: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of a type the `gguf` package cannot quantize to: (rows, bytes per row)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FLOAT16_FIELDS[kind]:
        values = rng.uniform(0.002, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = values[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
