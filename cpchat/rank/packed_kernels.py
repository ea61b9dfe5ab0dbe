"""Compiled CPU kernels for products straight from affine-quantized weights' stored bytes.

A weight of O outputs and I inputs quantized in groups of `gs` inputs is kept *packed by column*,
in blocks of BLOCK outputs stored one after another (each read in one sweep): in a block,
`packed[k, o]` is the k-th 32-bit word of output o's row (8 four-bit or 4 eight-bit values, the
lowest bits first, as MLX packs them), `scales[g, o]` and `biases[g, o]` its group g's affine
terms, so that w[o, i] = scales[g, o] * q[o, i] + biases[g, o]. Then for one input row x

    y[o] = sum_g scales[g, o] * sum_{i in g} q[o, i] x[i]  +  biases[g, o] * sum_{i in g} x[i]

and the inner loop runs over o, contiguous in every array, with x[i] held in registers: it
vectorizes, and each weight byte is read once for all the rows of a batched step. (By row, MLX's
own layout, a group's 4 words are too short a loop to vectorize: 3-5x slower, measured.)

Scales and biases stay in their stored dtype (bfloat16 and float16 as their 16 bits, widened a
block at a time), so the rank holds the file's bytes and no more.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cpchat.core.half_floats import widen

BLOCK = 128  # outputs a task: its rows' partial sums stay in L1

_jit = nb.njit(fastmath=True, boundscheck=False, cache=True, nogil=True)


def set_threads(threads: int) -> None:
    nb.set_num_threads(max(1, min(threads, nb.config.NUMBA_NUM_THREADS)))


@_jit
def _words4(w, part, x0, x1, x2, x3, x4, x5, x6, x7):
    for o in range(w.size):
        u = w[o]
        part[o] += (np.float32(np.int32(u & 15)) * x0 + np.float32(np.int32((u >> 4) & 15)) * x1
                    + np.float32(np.int32((u >> 8) & 15)) * x2 + np.float32(np.int32((u >> 12) & 15)) * x3
                    + np.float32(np.int32((u >> 16) & 15)) * x4 + np.float32(np.int32((u >> 20) & 15)) * x5
                    + np.float32(np.int32((u >> 24) & 15)) * x6 + np.float32(np.int32((u >> 28) & 15)) * x7)


@_jit
def _words8(w, part, x0, x1, x2, x3):
    for o in range(w.size):
        u = w[o]
        part[o] += (np.float32(np.int32(u & 255)) * x0 + np.float32(np.int32((u >> 8) & 255)) * x1
                    + np.float32(np.int32((u >> 16) & 255)) * x2 + np.float32(np.int32((u >> 24) & 255)) * x3)


@_jit
def _scale_add(acc, part, s, b, xg):
    for o in range(acc.size):
        acc[o] += s[o] * part[o] + b[o] * xg
        part[o] = 0


@_jit
def _block(flat, rows, lo, hi):
    """Outputs [lo, hi) of a weight stored block after block: their [rows, hi - lo] array."""
    return flat[lo * rows:hi * rows].reshape(rows, hi - lo)


@_jit
def _product_block(packed, scales, biases, words, kind, bits, x, xsum, y, lo, hi):
    groups, rows = xsum.shape[1], x.shape[0]
    per_group = words // groups
    per_word = 32 // bits
    packed, scales, biases = (_block(packed, words, lo, hi), _block(scales, groups, lo, hi),
                              _block(biases, groups, lo, hi))
    acc = np.zeros((rows, hi - lo), np.float32)
    part = np.zeros((rows, hi - lo), np.float32)
    s = np.empty(hi - lo, np.float32)
    b = np.empty(hi - lo, np.float32)
    for g in range(groups):
        for k in range(g * per_group, (g + 1) * per_group):
            w = packed[k]
            j = k * per_word
            for r in range(rows):  # x's values passed by value: the compiler keeps them in registers
                xr = x[r]
                if bits == 4:
                    _words4(w, part[r], xr[j], xr[j + 1], xr[j + 2], xr[j + 3],
                            xr[j + 4], xr[j + 5], xr[j + 6], xr[j + 7])
                else:
                    _words8(w, part[r], xr[j], xr[j + 1], xr[j + 2], xr[j + 3])
        widen(scales[g], s, kind)
        widen(biases[g], b, kind)
        for r in range(rows):
            _scale_add(acc[r], part[r], s, b, xsum[r, g])
    y[:, lo:hi] = acc


@_jit
def products(packed, scales, biases, words, kind, bits, x, xsum, y):
    """y[r] = W x[r] for the few rows of x (float32 [R, I]; xsum [R, G] its group sums), on this
    thread."""
    outputs = y.shape[1]
    for lo in range(0, outputs, BLOCK):
        _product_block(packed, scales, biases, words, kind, bits, x, xsum, y, lo, min(outputs, lo + BLOCK))


@nb.njit(fastmath=True, boundscheck=False, cache=True, nogil=True, parallel=True)
def products_parallel(packed, scales, biases, words, kind, bits, x, xsum, y):
    """`products` with the blocks of outputs shared over numba's threads."""
    outputs = y.shape[1]
    for b in nb.prange((outputs + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        _product_block(packed, scales, biases, words, kind, bits, x, xsum, y, lo, min(outputs, lo + BLOCK))


@_jit
def _dequantize_block(packed, scales, biases, words, kind, bits, out, lo, hi):
    groups = scales.size * words // packed.size
    per_group = words // groups
    per_word = 32 // bits
    mask = np.int32((1 << bits) - 1)
    packed, scales, biases = (_block(packed, words, lo, hi), _block(scales, groups, lo, hi),
                              _block(biases, groups, lo, hi))
    s = np.empty(hi - lo, np.float32)
    b = np.empty(hi - lo, np.float32)
    for g in range(groups):
        widen(scales[g], s, kind)
        widen(biases[g], b, kind)
        for k in range(g * per_group, (g + 1) * per_group):
            w = packed[k]
            for n in range(per_word):
                row = out[k * per_word + n, lo:hi]
                shift = np.int32(n * bits)
                for o in range(hi - lo):
                    row[o] = s[o] * np.float32(np.int32((w[o] >> shift) & mask)) + b[o]


@nb.njit(fastmath=True, boundscheck=False, cache=True, nogil=True, parallel=True)
def dequantize_parallel(packed, scales, biases, words, kind, bits, out):
    """out[i, o] = w[o, i] in float32 (the transposed weight, [I, O]) for a block's products."""
    outputs = out.shape[1]
    for b in nb.prange((outputs + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        _dequantize_block(packed, scales, biases, words, kind, bits, out, lo, min(outputs, lo + BLOCK))
