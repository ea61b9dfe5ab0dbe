"""16-bit floats, stored as their bits, widened to float32 inside compiled kernels (numba has no
float16 or bfloat16 type): bfloat16 is float32's top half; float16's magnitude bits shift into
float32's place and a rescale by 2^112 (the exponent biases' difference) makes them exact,
subnormals included."""

from __future__ import annotations

import numba as nb
import numpy as np

FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2  # the `kind` of what `widen` reads
_F16_RESCALE = np.float32(2.0 ** 112)


@nb.njit(fastmath=True, boundscheck=False, cache=True, nogil=True)
def widen(src, out, kind):
    """`src` (float32, or 16-bit floats' bits as uint16) as float32, into `out` (1-D, as long)."""
    if kind == FLOAT32:
        for i in range(src.size):
            out[i] = np.float32(src[i])
        return
    bits = out.view(np.uint32)
    for i in range(src.size):
        u = np.uint32(src[i])
        bits[i] = u << np.uint32(16) if kind == BFLOAT16 else (u & np.uint32(0x7FFF)) << np.uint32(13)
    if kind == FLOAT16:
        for i in range(src.size):
            v = out[i] * _F16_RESCALE
            out[i] = -v if np.uint32(src[i]) & np.uint32(0x8000) else v
