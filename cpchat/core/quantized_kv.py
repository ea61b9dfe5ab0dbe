"""Quantized K/V, as mlx-lm's `--kv-bits` keeps it: MLX's affine quantization along the head
dimension, each group of `group_size` values stored as `bits`-bit integers with a scale and a bias.

mlx-lm's `generate_step` starts with a full-precision cache and turns it into a QuantizedKVCache
after a forward call once the cache holds `quantized_kv_start` tokens or more. A call's queries attend
over the cache as it was at the call's start (its own keys stored alike), so a query attends to
quantized keys exactly when its call started at a position p > 0 with p >= quantized_kv_start.
mlx-lm's calls are the prompt in chunks of PREFILL_STEP (the last prompt token alone) and then one
a token; `quantized_from` finds, in cpchat's terms, the first position whose call was quantized.
Quantization is per token (its groups lie along the head dimension), so quantizing the earlier
tokens late or at once gives the same arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size
QUANTIZED_KV_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START


@dataclass(frozen=True)
class KVFormat:
    """How a ring keeps its K/V: the model's dtype (bits 0), or quantized from `start` on."""

    bits: int = 0
    group_size: int = 64
    start: int = QUANTIZED_KV_START

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def bytes_per_element(self, dtype_bytes: int) -> float:
        """Of K/V once quantized: the packed integers plus a scale and a bias (model dtype) a group."""
        if not self.quantized:
            return float(dtype_bytes)
        return self.bits / 8 + 2 * dtype_bytes / self.group_size


FULL_PRECISION = KVFormat()


@dataclass
class Packed:
    """One quantized K or V tensor [1, H, n, D]: uint32 words [.., D*bits/32], scales and biases
    [.., D/group_size] in the model's dtype."""

    words: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    PARTS = ("words", "scales", "biases")  # the arrays' names, in `arrays` order

    @property
    def arrays(self) -> list[mx.array]:
        return [self.words, self.scales, self.biases]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * self.group_size)

    def map(self, f) -> Packed:
        """The same tokens' words, scales and biases each through `f` (a slice, a take, a copy)."""
        return Packed(*(f(a) for a in self.arrays), self.bits, self.group_size)

    def dequantize(self) -> mx.array:
        """In float32, as attention computes (cpchat.core.attention): scale x q + bias rounded to a
        bfloat16 model's dtype would add an error as large as 8-bit quantization's own."""
        return mx.dequantize(self.words, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                             group_size=self.group_size, bits=self.bits)


KV = mx.array | Packed  # keys or values [1, H, n, D], full precision or quantized


def arrays_of(x: KV) -> list[mx.array]:
    """What K or V is made of: itself, or its words, scales and biases."""
    return x.arrays if isinstance(x, Packed) else [x]


def quantize(x: mx.array, fmt: KVFormat) -> Packed:
    return Packed(*mx.quantize(x, group_size=fmt.group_size, bits=fmt.bits), fmt.bits, fmt.group_size)


def concatenate(parts: list[KV], axis: int) -> KV:
    """Blocks of tokens joined, all full precision or all quantized alike."""
    if isinstance(parts[0], Packed):
        joined = [mx.concatenate([p.arrays[i] for p in parts], axis=axis) for i in range(3)]
        return Packed(*joined, parts[0].bits, parts[0].group_size)
    return mx.concatenate(parts, axis=axis)


def apply(x: KV, f) -> KV:
    """`f` (a slice or a take along the token or head axis) of full-precision or quantized K/V."""
    return x.map(f) if isinstance(x, Packed) else f(x)


def take(x: KV, index: mx.array, axis: int) -> KV:
    return apply(x, lambda a: mx.take(a, index, axis=axis))


def full_precision(x: KV) -> mx.array:
    return x.dequantize() if isinstance(x, Packed) else x


def packed(x: KV, fmt: KVFormat) -> Packed:
    """K or V quantized, unless it already is."""
    return x if isinstance(x, Packed) else quantize(x, fmt)


def quantized_from(start: int, tokens: int, kv_start: int, lone_first: bool = False) -> int:
    """The first position whose queries see quantized K/V, for a prefill of `tokens` new tokens at
    `start` over a cache not yet quantized, and the decode after it (every decode token is a call of
    its own). `lone_first`: the first new token is the previous answer's last, which mlx-lm read in a
    call of its own when it sampled the next (cpchat reads it with the next prompt)."""
    threshold = max(kv_start, 1)
    first = start + 1 if lone_first and tokens > 1 else start
    calls = ([start] if first > start else []) + list(range(first, start + tokens - 1, PREFILL_STEP))
    for call in [*calls, start + tokens - 1]:
        if call >= threshold:
            return call
    return max(threshold, start + tokens)
