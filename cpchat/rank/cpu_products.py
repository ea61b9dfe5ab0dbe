"""Weight products of low-precision models on the CPU: which way each layer multiplies.

Quantized layers the compiled kernels take multiply from their stored bytes (packed_weights);
what follows is for the rest (bfloat16 and float16 weights, other quantized forms), and for every
low-precision layer where the kernels cannot run.

MLX's CPU backend multiplies bfloat16 and float16 matrices 15x slower than float32 through
OpenBLAS, and quantized ones (bfloat16 scales) about 100x slower for a block of 256 tokens
(2048 x 6144 weights: 1.2 s and 23 s, against 0.08 s for float32, and 0.14 s to dequantize). So
on the CPU a rank computes a prefill block's products in float32 from the stored weights —
closer to the float32 truth than the native kernels, within mlx-lm's own low-precision noise.

Decode reads every weight once a token, and there too MLX's kernels are the slower way: SmolLM2's
4-bit matrix-vector products run 1.7x faster (1.9x on two BLAS threads) from float32 copies of
the weights. The copies cost 8x a 4-bit model's memory (2x a bfloat16 one's), so a rank keeps
them only where they fit in a small share of its free memory (`keep_float32_weights`), and
otherwise decodes with the native kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from cpchat.rank.packed_weights import MIN_ROWS, pack_model

COPY_SHARE = 8  # a rank keeps float32 copies that take at most 1/8 of its free memory


@dataclass
class _Copy:
    """A float32 copy of a layer's weight (not an mx.array attribute, so not a parameter)."""

    weight: mx.array


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


def _float32_weight(module: nn.Module) -> mx.array:
    """The layer's weight in float32 (scales too: dequantizing in float16 scales' own dtype rounds
    every weight to it, where MLX's native kernel multiplies in the activations' float32)."""
    if "scales" not in module:
        return module["weight"].astype(mx.float32)
    biases = module.get("biases")
    return mx.dequantize(module["weight"], module["scales"].astype(mx.float32),
                         None if biases is None else biases.astype(mx.float32),
                         group_size=module.group_size, bits=module.bits, mode=module.mode)


def _weight_for(module: nn.Module, x: mx.array) -> mx.array | None:
    """The float32 weight to multiply `x` by: the kept copy, or for a large block one made now;
    None where MLX's own kernel should run (a few rows, no copy)."""
    copy = getattr(module, "_float32", None)
    if copy is not None:
        return copy.weight
    return _float32_weight(module) if _rows(x) >= MIN_ROWS else None


class _Float32Products:
    def __call__(self, x: mx.array) -> mx.array:
        w = _weight_for(self, x)
        if w is None:
            return super().__call__(x)
        y = x.astype(mx.float32) @ w.T
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


class _Float32Head:
    """A tied output head (`as_linear`) with float32 products; the lookup stays as it is."""

    def as_linear(self, x: mx.array) -> mx.array:
        self.is_head = True  # seen in the load's probe forward: the model ties its head to it
        w = _weight_for(self, x)
        if w is None:
            return super().as_linear(x)
        return (x.astype(mx.float32) @ w.T).astype(x.dtype)


class Float32Linear(_Float32Products, nn.Linear):
    pass


class Float32QuantizedLinear(_Float32Products, nn.QuantizedLinear):
    pass


class Float32Embedding(_Float32Head, nn.Embedding):
    pass


class Float32QuantizedEmbedding(_Float32Head, nn.QuantizedEmbedding):
    pass


FLOAT32_CLASSES = {nn.QuantizedLinear: Float32QuantizedLinear, nn.Linear: Float32Linear,
                   nn.QuantizedEmbedding: Float32QuantizedEmbedding, nn.Embedding: Float32Embedding}


def _low_precision(module: nn.Module) -> bool:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return module.mode == "affine"
    return module["weight"].dtype in (mx.bfloat16, mx.float16)


@dataclass(frozen=True)
class Products:
    """How a model's low-precision layers multiply on the CPU, as `use_cpu_products` chose."""

    packed: int = 0  # from their stored quantized bytes (packed_weights)
    float32: int = 0  # in float32, as below
    note: str = ""  # why none is packed, where the kernels cannot run here


def use_cpu_products(model: nn.Module) -> Products:
    """Quantized layers the kernels take multiply from their bytes; every other low-precision layer
    in float32 for large blocks."""
    packed, note = pack_model(model)
    return Products(packed, use_float32_products(model), note)


def use_float32_products(model: nn.Module) -> int:
    """Give every low-precision linear layer (and embedding, for a tied head) float32 products for
    large blocks; how many changed."""
    changed = 0
    for _, module in model.named_modules():
        cls = FLOAT32_CLASSES.get(type(module))
        if cls is not None and module["weight"].size and _low_precision(module):  # size 0: another stage's
            module.__class__ = cls
            changed += 1
    return changed


def keep_float32_weights(model: nn.Module, budget_bytes: int) -> int:
    """Float32 copies of the weights of every layer `use_float32_products` changed (of an embedding,
    if a forward has used it as the output head), if they fit in `budget_bytes` together; the bytes
    kept (0: they did not fit, and decode stays native)."""
    layers = [m for _, m in model.named_modules() if type(m) in FLOAT32_CLASSES.values()
              and (not isinstance(m, _Float32Head) or getattr(m, "is_head", False))]
    need = sum(4 * m["weight"].shape[0] * _columns(m) for m in layers)
    if not layers or need > budget_bytes:
        return 0
    for m in layers:
        weight = _float32_weight(m)
        mx.eval(weight)  # one layer's at a time
        m._float32 = _Copy(weight)
    return need


def _columns(module: nn.Module) -> int:
    if "scales" in module:
        return module["weight"].shape[1] * 32 // module.bits
    return module["weight"].shape[1]
