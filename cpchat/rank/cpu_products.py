"""Weight products of low-precision models in float32 on the CPU, for blocks of many tokens.

MLX's CPU backend multiplies bfloat16 and float16 matrices 15x slower than float32 through
OpenBLAS, and quantized ones (bfloat16 scales) about 100x slower for a block of 256 tokens
(2048 x 6144 weights: 1.2 s and 23 s, against 0.08 s for float32, and 0.14 s to dequantize). So
on the CPU a rank computes a prefill block's products in float32 from the stored weights —
closer to the float32 truth than the native kernels, within mlx-lm's own low-precision noise —
and keeps the native kernels for decode, where one token reads the weights once either way.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MIN_ROWS = 16  # tokens in a block from which float32 products pay off (decode stays native)


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1]


class Float32Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) < MIN_ROWS:
            return super().__call__(x)
        y = x.astype(mx.float32) @ self["weight"].astype(mx.float32).T
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


class Float32QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) < MIN_ROWS:
            return super().__call__(x)
        # Scales in float32: dequantizing in their own dtype rounds every weight to it (float16 GGUF
        # scales lose 3 digits), where MLX's native kernel multiplies in the activations' float32.
        biases = self.get("biases")
        w = mx.dequantize(self["weight"], self["scales"].astype(mx.float32),
                          None if biases is None else biases.astype(mx.float32),
                          group_size=self.group_size, bits=self.bits, mode=self.mode)
        y = x.astype(mx.float32) @ w.T
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


def use_float32_products(model: nn.Module) -> int:
    """Give every low-precision linear layer float32 products for large blocks; how many changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and module.mode == "affine":
            module.__class__ = Float32QuantizedLinear
        elif type(module) is nn.Linear and module["weight"].dtype in (mx.bfloat16, mx.float16):
            module.__class__ = Float32Linear
        else:
            continue
        changed += 1
    return changed
