"""Read a GGUF file's header: its metadata and where each tensor's bytes lie.

The format (llama.cpp's gguf.md): the magic "GGUF", a version, the tensor and key counts, typed
key-value pairs, then one record per tensor (name, dimensions innermost first, GGML type, offset
into the data section), and the data section at the next multiple of `general.alignment`. Parsed
here with `struct` over a memory map: the `gguf` package's reader builds a numpy array per string,
which takes seconds for a 49K-token vocabulary. Tensor bytes stay in the map until asked for.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from cpchat.checkpoints import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: id -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as numpy and MLX see it (GGUF lists dimensions innermost first)
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]
    data_start: int
    header_digest: str  # sha256 of everything before the tensor data
    _map: mmap.mmap

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: object = None) -> object:
        """An architecture's own key (`llama.block_count` as get("block_count")) or a general one."""
        return self.metadata.get(f"{self.architecture}.{key}", self.metadata.get(key, default))

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes, rows of blocks: shape (rows..., bytes per row)."""
        block, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
        row_bytes = tensor.shape[-1] // block * block_bytes
        data = np.frombuffer(self._map, np.uint8, tensor.nbytes, tensor.offset)
        return data.reshape(*tensor.shape[:-1], row_bytes)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # an array still views it: the map closes when that array goes
            pass


class _Cursor:
    """Reads little-endian values from the map, refusing to read past its end."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.path, self.at = buffer, path, 0

    def take(self, fmt: str) -> object:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buffer):
            raise CheckpointError(f"{self.path} is truncated (its header ends early)")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.at + n > len(self.buffer):
            raise CheckpointError(f"{self.path} is truncated (its header ends early)")
        raw = self.buffer[self.at:self.at + n]
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item == STRING:
                return [self.string() for _ in range(count)]
            if item not in SCALARS:
                raise CheckpointError(f"{self.path} has a metadata array of unknown type {item}")
            dtype = np.dtype("<" + SCALARS[item])
            if self.at + count * dtype.itemsize > len(self.buffer):
                raise CheckpointError(f"{self.path} is truncated (its header ends early)")
            values = np.frombuffer(self.buffer, dtype, count, self.at).copy()
            self.at += count * dtype.itemsize
            return values
        if kind not in SCALARS:
            raise CheckpointError(f"{self.path} has a metadata value of unknown type {kind}")
        return self.take(SCALARS[kind])


def read_gguf(path: Path) -> GGUFFile:
    """The header of the GGUF file at `path`; CheckpointError (one line) for anything else."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise CheckpointError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    try:
        return _parse(buffer, path)
    except BaseException:
        buffer.close()
        raise


def _parse(buffer: mmap.mmap, path: Path) -> GGUFFile:
    c = _Cursor(buffer, path)
    c.at = 4
    version = c.take("I")
    if version not in VERSIONS:
        raise CheckpointError(f"{path} is GGUF version {version}; cpchat reads versions 2 and 3")
    n_tensors, n_keys = c.take("Q"), c.take("Q")
    metadata: dict[str, object] = {}
    for _ in range(n_keys):
        key = c.string()
        metadata[key] = c.value(c.take("I"))
    records = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        records.append((name, tuple(reversed(dims)), c.take("I"), c.take("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-c.at // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in records:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {name} has GGML type {type_id}, which cpchat does not "
                                  "know (a newer llama.cpp format?)") from None
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        if shape and shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {name} rows of {shape[-1]} are not whole "
                                  f"{ggml_type.name} blocks")
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        info = TensorInfo(name, shape, ggml_type, data_start + offset, nbytes)
        if info.offset + nbytes > len(buffer):
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {info.offset + nbytes:,}"
                                  f" of a {len(buffer):,}-byte file")
        tensors[name] = info
    digest = hashlib.sha256(buffer[:data_start]).hexdigest()
    return GGUFFile(path, metadata, tensors, data_start, digest, buffer)
