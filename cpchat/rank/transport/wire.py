"""Tensors to and from Ring frames: raw bytes with dtype and shape, never pickle.

A block (a few tensors sharing one key) is cut into frames of at most
CHUNK_BYTES; `BlockAssembler` puts them back together and validates every
header against the bytes it carries.

The transport threads compute nothing in MLX (but mx.distributed's send and recv,
on streams of their own): an MLX array made lazily on one thread cannot be
evaluated on another ("There is no Stream(cpu, N) in current thread"), so
tensors become `HostTensor`s (numpy) with `to_host` on the computing thread
before they travel, and MLX arrays again with `to_mlx` on the thread that takes
them. A receiving thread may copy bytes into a new MLX array (made from data,
it needs no stream), which `to_mlx` then views without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cpchat.protocol import cpchat_pb2 as pb

# gRPC Python moves 4 MiB messages faster than larger ones (docs/design.md §4); measured on the ring
# with 16 MiB blocks, interleaved: 0.59-1.01 GB/s per link in 4 MiB frames, 0.44-0.70 in 16 MiB.
CHUNK_BYTES = 4 << 20
MAX_TENSORS = 12  # the largest block: Ulysses' queries, their positions and packed K/V (9)
MAX_BLOCK_BYTES = 8 << 30

# Wire dtype -> (numpy storage dtype, mlx dtype). bfloat16 travels as its uint16 bits.
DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "float32": (np.dtype("<f4"), mx.float32),
    "float16": (np.dtype("<f2"), mx.float16),
    "bfloat16": (np.dtype("<u2"), mx.bfloat16),
    "int32": (np.dtype("<i4"), mx.int32),
    "int64": (np.dtype("<i8"), mx.int64),
    "uint32": (np.dtype("<u4"), mx.uint32),
}
_NAMES = {mlx: name for name, (_, mlx) in DTYPES.items()}


class FrameError(ValueError):
    """A frame that does not describe a valid tensor block."""


@dataclass(frozen=True)
class BlockKey:
    request_id: str
    layer: int
    step: int
    kind: int  # pb.FrameKind


@dataclass(frozen=True)
class HostTensor:
    """A tensor's bytes in host memory: `data` holds the wire dtype's numpy storage dtype. A link
    whose receiving thread copied the bytes into MLX memory (as bytes) leaves that array in `array`,
    a view of which `data` is: `to_mlx` then copies nothing."""

    dtype: str
    data: np.ndarray
    array: mx.array | None = None

    def raw(self) -> memoryview:
        return memoryview(self.data.reshape(-1).view(np.uint8))


def to_host(a: mx.array) -> HostTensor:
    """An array's bytes as numpy (zero-copy where MLX's buffer is contiguous); evaluates it."""
    if a.dtype not in _NAMES:
        raise FrameError(f"dtype {a.dtype} cannot travel the ring")
    name = _NAMES[a.dtype]
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return HostTensor(name, np.ascontiguousarray(a))


def to_mlx(t: HostTensor) -> mx.array:
    if t.array is not None:
        return t.array.view(DTYPES[t.dtype][1]).reshape(t.data.shape)
    a = mx.array(t.data)
    return a.view(DTYPES[t.dtype][1]) if t.dtype == "bfloat16" else a


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DATA_TAG = bytes([(pb.Frame.DATA_FIELD_NUMBER << 3) | 2])  # field 13, length-delimited


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise FrameError("truncated or overlong varint in frame")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def parse_frame(raw: bytes) -> tuple[pb.Frame, memoryview]:
    """A serialized `Frame` split into its header (parsed by protobuf) and a view of its data
    bytes, which are not copied. Fields may come in any order, as protobuf allows."""
    view = memoryview(raw)
    header: list[memoryview] = []
    data = view[:0]
    pos = 0
    while pos < len(view):
        start = pos
        tag, pos = _read_varint(view, pos)
        wire_type = tag & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise FrameError("frame field runs past the end of the message")
            if tag >> 3 == pb.Frame.DATA_FIELD_NUMBER:
                data = view[pos : pos + length]  # the last one wins, as in protobuf
                pos += length
                continue
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise FrameError(f"frame field with wire type {wire_type}")
        header.append(view[start:pos])
    if pos != len(view):
        raise FrameError("frame field runs past the end of the message")
    try:
        return pb.Frame.FromString(b"".join(header)), data
    except Exception as e:  # protobuf's DecodeError
        raise FrameError(f"malformed frame header: {e}") from None


def block_chunks(ring_id: str, key: BlockKey, source_rank: int, tensors: list[HostTensor]
                 ) -> Iterator[tuple[bytes, memoryview]]:
    """One block as (serialized `Frame` header without its data, that frame's data bytes) pairs:
    each tensor cut into chunks of at most CHUNK_BYTES."""
    for index, t in enumerate(tensors):
        raw = t.raw()
        count = max(1, -(-len(raw) // CHUNK_BYTES))
        for chunk in range(count):
            header = pb.Frame(
                ring_id=ring_id,
                request_id=key.request_id,
                layer=key.layer,
                step=key.step,
                kind=key.kind,
                source_rank=source_rank,
                tensor_index=index,
                tensor_count=len(tensors),
                chunk_index=chunk,
                chunk_count=count,
                dtype=t.dtype,
                shape=list(t.data.shape),
            ).SerializeToString()
            yield header, raw[chunk * CHUNK_BYTES : (chunk + 1) * CHUNK_BYTES]


def block_frames(ring_id: str, key: BlockKey, source_rank: int, tensors: list[HostTensor]) -> Iterator[bytes]:
    """Serialized `Frame` messages for one block.

    The header is serialized by protobuf and the data field appended by hand, so
    each chunk's bytes are copied once, straight from the tensor's buffer.
    """
    for header, data in block_chunks(ring_id, key, source_rank, tensors):
        yield block_frame(header, data)


def block_frame(header: bytes, data: memoryview) -> bytes:
    """A serialized `Frame`: its header (from `block_chunks`) with its data field."""
    return b"".join((header, _DATA_TAG, _varint(len(data)), data))


def block_nbytes(tensors: list[mx.array]) -> int:
    return sum(t.nbytes for t in tensors)


def gather_buffer(nbytes: int) -> tuple[mx.array | None, np.ndarray]:
    """Where a tensor's chunks are gathered: on the CPU, the memory of a fresh MLX array, written
    in place through numpy (the array is ours alone until the block is complete), so `to_mlx`
    copies nothing more; elsewhere (a GPU's memory may not be the host's) a numpy buffer."""
    if mx.default_device() != mx.cpu:
        return None, np.empty(nbytes, dtype=np.uint8)
    array = mx.zeros((nbytes,), mx.uint8, stream=mx.cpu)
    return array, np.asarray(array)


class BlockAssembler:
    """Collects the frames of one block; `add` returns the tensors once complete.

    A tensor sent in one chunk is a view of the received bytes; one cut into
    chunks is gathered in a buffer of its own first (`gather_buffer`).
    """

    def __init__(self, first: pb.Frame) -> None:
        if not 1 <= first.tensor_count <= MAX_TENSORS:
            raise FrameError(f"tensor_count {first.tensor_count} outside 1..{MAX_TENSORS}")
        self.source_rank = first.source_rank
        self.count = first.tensor_count
        self.headers: list[tuple[str, tuple[int, ...]] | None] = [None] * self.count
        self.buffers: list[np.ndarray | memoryview | None] = [None] * self.count
        self.arrays: list[mx.array | None] = [None] * self.count
        self.seen: list[set[int]] = [set() for _ in range(self.count)]
        self.missing = 0  # chunks still expected for the tensors whose first frame arrived

    def add(self, f: pb.Frame, data: memoryview, array: mx.array | None = None) -> list[HostTensor] | None:
        """Add one frame: its parsed header and its data bytes (see `parse_frame`); `array`, if
        given, holds those bytes in MLX memory and `data` is a view of it."""
        if f.tensor_count != self.count or f.source_rank != self.source_rank:
            raise FrameError("frames of one block disagree on tensor_count or source_rank")
        if f.tensor_index >= self.count:
            raise FrameError(f"tensor_index {f.tensor_index} >= tensor_count {self.count}")
        if f.dtype not in DTYPES:
            raise FrameError(f"dtype {f.dtype!r} is not one of {', '.join(DTYPES)}")
        shape = tuple(f.shape)
        nbytes = math.prod(shape) * DTYPES[f.dtype][0].itemsize
        if nbytes > MAX_BLOCK_BYTES:
            raise FrameError(f"tensor of {nbytes} bytes exceeds the {MAX_BLOCK_BYTES} byte limit")
        expected_chunks = max(1, -(-nbytes // CHUNK_BYTES))
        if f.chunk_count != expected_chunks or f.chunk_index >= f.chunk_count:
            raise FrameError(f"chunk {f.chunk_index}/{f.chunk_count} does not fit a {nbytes}-byte tensor")
        i = f.tensor_index
        if self.headers[i] is None:
            self.headers[i] = (f.dtype, shape)
            if f.chunk_count > 1:
                self.arrays[i], self.buffers[i] = gather_buffer(nbytes)
            self.missing += f.chunk_count
        elif self.headers[i] != (f.dtype, shape):
            raise FrameError(f"frames of tensor {i} disagree on dtype or shape")
        offset = f.chunk_index * CHUNK_BYTES
        want = min(CHUNK_BYTES, nbytes - offset)
        if len(data) != want:
            raise FrameError(f"chunk {f.chunk_index} of tensor {i} has {len(data)} bytes, expected {want}")
        if f.chunk_index in self.seen[i]:
            raise FrameError(f"chunk {f.chunk_index} of tensor {i} arrived twice")
        self.seen[i].add(f.chunk_index)
        if f.chunk_count == 1:
            self.buffers[i], self.arrays[i] = data, array
        else:
            self.buffers[i][offset : offset + want] = np.frombuffer(data, dtype=np.uint8)
        self.missing -= 1
        if self.missing or any(h is None for h in self.headers):
            return None
        return [self._tensor(i) for i in range(self.count)]

    def _tensor(self, i: int) -> HostTensor:
        dtype, shape = self.headers[i]
        data = np.frombuffer(self.buffers[i], dtype=DTYPES[dtype][0]).reshape(shape)
        self.buffers[i] = None
        return HostTensor(dtype, data, self.arrays[i])
