import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.transport import wire
from cpchat.rank.transport.wire import (
    BlockAssembler,
    BlockKey,
    FrameError,
    block_frames,
    parse_frame,
    to_host,
    to_mlx,
)

KEY = BlockKey("req", 3, 1, pb.KV)


def frames_of(tensors, source_rank=2):
    return [parse_frame(raw) for raw in block_frames("ring", KEY, source_rank, [to_host(a) for a in tensors])]


def roundtrip(tensors):
    frames = frames_of(tensors)
    assembler = BlockAssembler(frames[0][0])
    results = [assembler.add(f, data) for f, data in frames]
    assert all(r is None for r in results[:-1])
    return frames, [to_mlx(t) for t in results[-1]]


@pytest.mark.parametrize("chunk_bytes", [wire.CHUNK_BYTES, 64])  # one frame, or gathered from chunks
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.int64, mx.uint32])
def test_tensors_roundtrip_bit_exact(dtype, chunk_bytes, monkeypatch):
    monkeypatch.setattr(wire, "CHUNK_BYTES", chunk_bytes)
    a = (mx.random.normal((2, 3, 5, 4)) * 100).astype(dtype)
    _, (b,) = roundtrip([a])
    assert b.dtype == dtype and b.shape == a.shape
    assert mx.array_equal(a, b).item()


def test_large_blocks_split_into_bounded_frames(monkeypatch):
    monkeypatch.setattr(wire, "CHUNK_BYTES", 1000)
    k = mx.arange(3000, dtype=mx.float32).reshape(1, 1, 750, 4)
    v = k[..., ::2]  # non-contiguous slice
    positions = mx.arange(750, dtype=mx.int32)
    frames, out = roundtrip([k, v, positions, mx.zeros((0,), mx.int32)])
    assert max(len(data) for _, data in frames) <= 1000
    assert len(frames) == 12 + 6 + 3 + 1
    assert all(mx.array_equal(a, b).item() for a, b in zip([k, v, positions], out[:3], strict=True))
    assert out[3].shape == (0,)


def frame(**overrides):
    """A one-tensor frame with some header fields changed, as (header, data) off the wire."""
    f, data = frames_of([mx.zeros((2, 2), mx.float32)], source_rank=0)[0]
    f.data = bytes(data)
    for name, value in overrides.items():
        if name == "shape":
            del f.shape[:]
            f.shape.extend(value)
        else:
            setattr(f, name, value)
    return parse_frame(f.SerializeToString())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dtype="complex64"), "dtype"),
        (dict(shape=[3, 2]), "bytes"),
        (dict(data=b"\0" * 15), "bytes"),
        (dict(chunk_count=2), "chunk"),
        (dict(tensor_count=0), "tensor_count"),
        (dict(tensor_count=99), "tensor_count"),
        (dict(shape=[1 << 20, 1 << 20]), "limit"),
    ],
)
def test_malformed_frames_are_refused(overrides, message):
    with pytest.raises(FrameError, match=message):
        f, data = frame(**overrides)
        BlockAssembler(f).add(f, data)


def test_duplicate_chunk_is_refused():
    f, data = frame()
    assembler = BlockAssembler(frame(tensor_count=2)[0])
    g, g_data = frame(tensor_count=2)
    assembler.add(g, g_data)
    with pytest.raises(FrameError, match="twice"):
        assembler.add(g, g_data)
    assert f.dtype == "float32" and np.frombuffer(data, np.float32).size == 4


def test_parse_frame_takes_fields_in_any_order():
    header = pb.Frame(ring_id="r", request_id="q", layer=2, kind=pb.KV, tensor_count=1, chunk_count=1,
                      dtype="int32", shape=[3])
    data = np.arange(3, dtype="<i4").tobytes()
    # data first, then the header: valid protobuf, though block_frames never writes it so
    raw = pb.Frame(data=data).SerializeToString() + header.SerializeToString()
    parsed, view = parse_frame(raw)
    assert bytes(view) == data and parsed == header
    full = pb.Frame.FromString(raw)
    assert full.data == data and parsed.request_id == full.request_id and not parsed.data


@pytest.mark.parametrize(
    "raw, message",
    [
        (bytes([0x6A, 0x10]) + b"short", "past the end"),  # data claims 16 bytes, has 5
        (bytes([0x0B]), "wire type 3"),  # a group
        (bytes([0x18, 0x80]), "varint"),  # layer's varint never ends
        (bytes([0x0A, 0x02, 0xFF, 0xFE]), "malformed frame header"),  # ring_id not UTF-8
    ],
)
def test_parse_frame_refuses_broken_bytes(raw, message):
    with pytest.raises(FrameError, match=message):
        parse_frame(raw)


@given(st.binary(max_size=64))
def test_parse_frame_raises_only_frame_errors(raw):
    try:
        header, data = parse_frame(raw)
    except FrameError:
        return
    assert len(data) <= len(raw) and isinstance(header, pb.Frame)
