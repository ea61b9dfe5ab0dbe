"""A GGUF file's tensors as mlx-lm weights: Hugging Face names, and MLX's own quantized form.

MLX's affine quantization keeps, per group of 32 values, a scale and a bias: x = scale·q + bias.
Most GGUF block types are exactly that per 32 values, and are repacked value for value (`exact`):
Q4_0 and Q5_0 (x = d·(q - 8) or d·(q - 16)), Q4_1 and Q5_1 (x = d·q + m), Q8_0 (x = d·q with q
signed), and the K-quants Q4_K and Q5_K, whose super-blocks of 256 hold eight sub-blocks of 32 with
6-bit scales and minima (x = d·sc·q - dmin·m). The scales are kept in float16, as MLX's own GGUF
loader keeps them. F32, F16 and BF16 stay as they are. The other types have sub-blocks of 16 (Q2_K,
Q3_K, Q6_K) or non-uniform levels (IQ4_NL, IQ4_XS): they are dequantized by the `gguf` package and
requantized with the bits of `REQUANTIZE_BITS`, chosen so that the rounding they add is at most a
quarter of the file's own (measured on llama.cpp's quantizations of a random model: Q6_K at 8 bits
adds 0.29× its RMS error, Q3_K at 5 bits 0.23×, Q2_K at 4 bits 0.27×, IQ4_NL at 6 bits 0.22×).

llama.cpp stores a llama-family model's q and k projections with each head's rows interleaved for
its RoPE (pairs of adjacent dimensions); mlx-lm rotates the two halves of a head, so those rows are
put back. Gemma's converter adds 1 to every norm weight (Gemma scales by 1 + w); it is taken off.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_file import GGUFFile, TensorInfo

GROUP_SIZE = 32
EXACT_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
REQUANTIZE_BITS = {T.Q2_K: 4, T.Q3_K: 5, T.IQ4_NL: 6, T.IQ4_XS: 6}
DEFAULT_REQUANTIZE_BITS = 8  # Q6_K, Q8_K and the rest
KEPT = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms the attention's output and both sides of the MLP
GEMMA3_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Tensors read into the config (rope_freqs) or left out: a vision tower and its projector (Gemma 3
# from Ollama carries them), which a text model does not use.
NOT_WEIGHTS = ("rope_freqs.", "v.", "mm.")


def hf_name(name: str, arch: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; CheckpointError when unknown."""
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    raise CheckpointError(f"tensor {name} has no place in an mlx-lm {arch} model (a layer kind cpchat "
                          "does not convert, such as mixture-of-experts)")


def mlx_weights(f: GGUFFile, config: dict) -> Iterator[tuple[str, dict[str, mx.array], str | None]]:
    """(mlx-lm name without `.weight`, its arrays, a note when the tensor was requantized) per tensor."""
    arch = f.architecture
    for name, tensor in f.tensors.items():
        if name.startswith(NOT_WEIGHTS):
            continue
        target = hf_name(name, arch)
        arrays, note = convert_tensor(f, tensor)
        if arch == "llama" and target.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            arrays = {k: unpermute_rows(v, config["num_attention_heads"]) for k, v in arrays.items()}
        elif arch == "llama" and target.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            arrays = {k: unpermute_rows(v, config["num_key_value_heads"]) for k, v in arrays.items()}
        if arch == "gemma3" and target.endswith("norm.weight"):
            arrays = {"weight": arrays["weight"] - 1}
        prefix, _, kind = target.rpartition(".")
        if kind == "bias":
            yield prefix, {"bias": arrays["weight"]}, note
        else:
            yield prefix, arrays, note


def convert_tensor(f: GGUFFile, tensor: TensorInfo) -> tuple[dict[str, mx.array], str | None]:
    """{"weight": ...} or MLX's quantized {"weight", "scales", "biases"}, and a note if requantized."""
    raw = f.raw(tensor)
    kind = tensor.ggml_type
    if kind in KEPT:
        array = mx.array(raw.view(KEPT[kind]).reshape(tensor.shape))
        return {"weight": array.view(mx.bfloat16) if kind == T.BF16 else array}, None
    if len(tensor.shape) != 2:
        raise CheckpointError(f"{f.path.name}: tensor {tensor.name} is {kind.name} but not a matrix")
    if kind in EXACT_BITS:
        q, scale, bias = affine_groups(raw, kind)
        return mlx_affine(q, scale, bias, EXACT_BITS[kind]), None
    try:
        values = dequantize(raw, kind)
    except NotImplementedError:
        raise CheckpointError(f"{f.path.name}: tensor {tensor.name} is {kind.name}, which the gguf package "
                              "cannot dequantize") from None
    bits = REQUANTIZE_BITS.get(kind, DEFAULT_REQUANTIZE_BITS)
    weight, scales, biases = mx.quantize(mx.array(values.reshape(tensor.shape)), GROUP_SIZE, bits)
    return {"weight": weight, "scales": _half(scales), "biases": _half(biases)}, f"{kind.name} -> {bits}-bit"


def affine_groups(raw: np.ndarray, kind: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, bias) of each group of 32 values of an exact type: q (rows, groups, 32) as unsigned
    integers, scale and bias (rows, groups) in float32, with x = scale·q + bias."""
    rows = raw.shape[0]
    if kind in (T.Q4_K, T.Q5_K):
        return _k_quant_groups(raw.reshape(rows, -1, 144 if kind == T.Q4_K else 176), kind)
    size = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}[kind]
    blocks = raw.reshape(rows, -1, size)
    d = _f16(blocks[..., 0:2])
    if kind == T.Q8_0:
        return (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d
    with_min = kind in (T.Q4_1, T.Q5_1)
    start = 4 if with_min else 2
    if kind in (T.Q5_0, T.Q5_1):  # 4 bytes of fifth bits, value j's in bit j
        high = (blocks[..., start:start + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        start += 4
    else:
        high = 0
    nibbles = blocks[..., start:]  # value j in the low nibble of byte j, value j + 16 in its high nibble
    q = (np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | (high << 4)).astype(np.uint8)
    middle = 8 if kind == T.Q4_0 else 16
    return q, d, _f16(blocks[..., 2:4]) if with_min else -middle * d


def _k_quant_groups(blocks: np.ndarray, kind: T) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: d, dmin, twelve bytes of 6-bit scales and minima for the eight sub-blocks, (Q5_K:
    32 bytes of fifth bits, sub-block j's in bit j), then 128 bytes of nibbles: chunk c of 32 bytes
    holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    rows, supers = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    nibbles = blocks[..., -128:].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (nibbles & 0x0F).reshape(rows, supers, 8, 32)
    if kind == T.Q5_K:
        high = blocks[..., 16:48].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        q = q | ((high & 1) << 4)
    scale = d[..., None] * sc.reshape(rows, supers, 8)
    bias = -dmin[..., None] * m.reshape(rows, supers, 8)
    return q.reshape(rows, -1, 32), scale.reshape(rows, -1), bias.reshape(rows, -1)


def mlx_affine(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> dict[str, mx.array]:
    """MLX's packing: each row's values as one little-endian bit stream of `bits`-bit integers."""
    rows = q.shape[0]
    stream = ((q.reshape(rows, -1, 1) >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows, -1)
    packed = np.packbits(stream, axis=-1, bitorder="little").view(np.uint32)
    return {"weight": mx.array(packed), "scales": _half(mx.array(scale)), "biases": _half(mx.array(bias))}


def _f16(pairs: np.ndarray) -> np.ndarray:
    """Two bytes per value (the last axis) read as float16, returned in float32."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)


def _half(x: mx.array) -> mx.array:
    """float16, as MLX's own GGUF loader keeps scales, unless a value would not fit in it."""
    return x.astype(mx.float16) if mx.abs(x).max().item() < 65504 else x.astype(mx.float32)


def unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of q/k rows (its `permute` in convert_hf_to_gguf)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
