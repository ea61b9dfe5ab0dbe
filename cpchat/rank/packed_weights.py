"""Quantized linear layers and embeddings that multiply from their stored bytes on the CPU.

MLX's CPU kernels for quantized matrices are many times slower than reading the bytes allows, and
float32 copies cost 8x a 4-bit model's memory. Here an affine 4- or 8-bit weight (MLX's own, or a
GGUF's Q4_0, Q4_1 and Q8_0, which load as MLX's) is repacked once, by column (packed_kernels), and
kept only so: a decode step's few rows multiply it in compiled kernels that read each byte once
for all rows; a prefill block's many rows dequantize it into one float32 buffer per shape, reused
by every layer, and multiply that on the BLAS.

The compiled kernels are numba's, cached on disk the first time (about 25 s on 2 cores); where numba cannot
be imported or compiled the layers stay as they were, and `status()` says why.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MIN_ROWS = 16  # rows of x from which a dequantized float32 weight and the BLAS are faster
PARALLEL_WEIGHTS = 1 << 19  # weights from which a product is shared over the threads
_SCALE_KINDS = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2}


@functools.cache
def status() -> tuple[ModuleType | None, str]:
    """The kernels module, compiled (or read from numba's cache), or None and why not."""
    try:
        from cpchat.rank import packed_kernels as kernels

        kernels.set_threads(_threads())
        _warm(kernels)
        return kernels, ""
    except Exception as e:  # noqa: BLE001 (any failure to import or compile means: fall back)
        return None, f"packed products unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]})"


@functools.cache
def _threads() -> int:
    """The rank's BLAS threads (blas.thread_environment sets them before it starts)."""
    return max(int(os.environ.get("OPENBLAS_NUM_THREADS", "0") or 0), 1)


def _warm(kernels: ModuleType) -> None:
    """Compile (or load from cache) every kernel for every scale dtype, on tiny weights, so that no
    request pays for it."""
    x = np.ones((1, 32), np.float32)
    for dtype, kind in ((np.float32, 0), (np.uint16, 1)):  # a signature a stored dtype
        for bits in (4, 8):
            words = bits  # a group of 32 values
            packed, affine = np.zeros(2 * words, np.int32), np.zeros(2, dtype)
            y = np.empty((1, 2), np.float32)
            for product in (kernels.products, kernels.products_parallel):
                product(packed, affine, affine, words, kind, bits, x, x[:, :1], y)
            out = np.empty((32, 2), np.float32)
            kernels.dequantize_parallel(packed, affine, affine, words, kind, bits, out)


@dataclass
class _Views:
    """numpy views (no copies) of a packed layer's MLX arrays, for the kernels (packed_kernels: block
    after block of BLOCK outputs, each by column)."""

    packed: np.ndarray  # int32, `words` a row
    scales: np.ndarray  # float32, or bfloat16/float16 as uint16, a group's a row
    biases: np.ndarray
    kind: int
    bits: int
    group_size: int
    outputs: int

    @property
    def words(self) -> int:
        return self.packed.size // self.outputs

    @property
    def shape(self) -> tuple[int, int]:
        return self.outputs, self.words * 32 // self.bits

    def rows(self, flat: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of one of the arrays (`flat`), as MLX lays them out: [len(ids), its columns]."""
        columns, block = flat.size // self.outputs, _block()
        lo = ids // block * block
        width = np.minimum(block, self.outputs - lo)
        at = (lo * columns)[:, None] + np.arange(columns)[None, :] * width[:, None] + (ids - lo)[:, None]
        return flat[at]


def _block() -> int:
    return status()[0].BLOCK


def _by_blocks(a: mx.array) -> mx.array:
    """[O, C] as the kernels keep it: blocks of BLOCK rows, each transposed, one after another."""
    block = _block()
    return mx.concatenate([mx.contiguous(a[lo:lo + block].T).reshape(-1)
                           for lo in range(0, a.shape[0], block)])


def packable(module: nn.Module) -> bool:
    return (isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and module.mode == "affine"
            and module.bits in (4, 8) and module["weight"].size > 0 and "biases" in module
            and module["scales"].dtype in _SCALE_KINDS)


def pack(module: nn.Module) -> None:
    """Repack `module`'s weight by column in place of MLX's layout and give it the packed class."""
    scale_dtype = module["scales"].dtype
    as_stored = (lambda a: a) if scale_dtype == mx.float32 else (lambda a: a.view(mx.uint16))
    outputs = module["weight"].shape[0]
    arrays = {"packed": _by_blocks(module["weight"].view(mx.int32)),
              "packed_scales": _by_blocks(as_stored(module["scales"])),
              "packed_biases": _by_blocks(as_stored(module["biases"]))}
    mx.eval(arrays)
    for name in ("weight", "scales", "biases"):
        del module[name]
    for name, array in arrays.items():
        module[name] = array
    module._views = _Views(*(np.asarray(arrays[n]) for n in arrays), _SCALE_KINDS[scale_dtype],
                           module.bits, module.group_size, outputs)
    module._out_dtype = scale_dtype  # an embedding's lookup returns it, as MLX's does
    module.__class__ = PackedQuantizedEmbedding if isinstance(module, nn.QuantizedEmbedding) \
        else PackedQuantizedLinear


_parallel = threading.Lock()  # numba's workqueue threads serve one parallel kernel at a time


def _rows_product(v: _Views, x: np.ndarray) -> np.ndarray:
    kernels, _ = status()
    rows = x.shape[0]
    y = np.empty((rows, v.shape[0]), np.float32)
    xsum = x.reshape(rows, -1, v.group_size).sum(-1)
    if _threads() > 1 and v.packed.size * 32 // v.bits >= PARALLEL_WEIGHTS:
        with _parallel:
            kernels.products_parallel(v.packed, v.scales, v.biases, v.words, v.kind, v.bits, x, xsum, y)
    else:
        kernels.products(v.packed, v.scales, v.biases, v.words, v.kind, v.bits, x, xsum, y)
    return y


@functools.cache
def _buffer(inputs: int, outputs: int) -> tuple[mx.array, np.ndarray]:
    """One float32 [inputs, outputs] buffer a shape, shared by every layer of that shape; the numpy
    view writes into the MLX array's memory (a prefill evaluates each product before the next)."""
    buffer = mx.array(np.empty((inputs, outputs), np.float32))
    mx.eval(buffer)
    return buffer, np.asarray(buffer)


def _dequantize(v: _Views, out: np.ndarray | None = None) -> np.ndarray:
    """The weight, transposed ([inputs, outputs]), in float32: into `out`, or a new array."""
    outputs, inputs = v.shape
    out = np.empty((inputs, outputs), np.float32) if out is None else out
    kernels, _ = status()
    with _parallel:
        kernels.dequantize_parallel(v.packed, v.scales, v.biases, v.words, v.kind, v.bits, out)
    return out


def _dequantized(v: _Views, keep: bool) -> mx.array:
    """`_dequantize` in the shape's shared buffer, or (keep=False) in a new one."""
    if not keep:
        return mx.array(_dequantize(v))
    buffer, view = _buffer(*reversed(v.shape))
    _dequantize(v, view)
    return buffer


def packed_matmul(v: _Views, x: mx.array, keep_buffer: bool = True) -> mx.array:
    """x @ W.T in float32, x of any leading shape."""
    outputs, inputs = v.shape
    flat = x.reshape(-1, inputs).astype(mx.float32)
    if flat.shape[0] < MIN_ROWS:
        y = mx.array(_rows_product(v, np.ascontiguousarray(np.asarray(flat))))
    else:
        y = flat @ _dequantized(v, keep_buffer)
        mx.eval(y)  # before the next layer of this shape writes the buffer
    return y.reshape(*x.shape[:-1], outputs)


class PackedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = packed_matmul(self._views, x)
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


class PackedQuantizedEmbedding(nn.QuantizedEmbedding):
    """The lookup dequantizes the rows asked for with MLX's own `dequantize`, as MLX's embedding does;
    as the tied output head, products as above (its buffer, the model's largest, is not kept)."""

    def __call__(self, ids: mx.array) -> mx.array:
        v: _Views = self._views
        flat = np.asarray(ids).reshape(-1).astype(np.int64)

        def rows(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
            return mx.array(v.rows(array, flat)).view(dtype)

        dtype = self._out_dtype
        out = mx.dequantize(rows(v.packed, mx.uint32), rows(v.scales, dtype), rows(v.biases, dtype),
                            group_size=self.group_size, bits=self.bits)
        return out.reshape(*ids.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return packed_matmul(self._views, x, keep_buffer=False).astype(x.dtype)


def pack_model(model: nn.Module) -> tuple[int, str]:
    """Pack every quantized layer the kernels take; how many, and why none where they cannot run."""
    layers = [m for _, m in model.named_modules() if packable(m)]
    if not layers:
        return 0, ""
    kernels, why = status()
    if kernels is None:
        return 0, why
    _buffer.cache_clear()  # another model's shapes
    for module in layers:
        pack(module)
    return len(layers), ""
