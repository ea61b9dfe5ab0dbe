import mlx.core as mx
import numpy as np
import pytest

from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank import wire
from cpchat.rank.wire import BlockAssembler, BlockKey, FrameError, block_frames

KEY = BlockKey("req", 3, 1, pb.KV)


def frames_of(tensors, source_rank=2):
    return [pb.Frame.FromString(raw) for raw in block_frames("ring", KEY, source_rank, tensors)]


def roundtrip(tensors):
    frames = frames_of(tensors)
    assembler = BlockAssembler(frames[0])
    results = [assembler.add(f) for f in frames]
    assert all(r is None for r in results[:-1])
    return frames, results[-1]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.int64, mx.uint32])
def test_tensors_roundtrip_bit_exact(dtype):
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
    assert max(len(f.data) for f in frames) <= 1000
    assert len(frames) == 12 + 6 + 3 + 1
    assert all(mx.array_equal(a, b).item() for a, b in zip([k, v, positions], out[:3], strict=True))
    assert out[3].shape == (0,)


def frame(**overrides):
    f = frames_of([mx.zeros((2, 2), mx.float32)], source_rank=0)[0]
    for name, value in overrides.items():
        if name == "shape":
            del f.shape[:]
            f.shape.extend(value)
        else:
            setattr(f, name, value)
    return f


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
        f = frame(**overrides)
        BlockAssembler(f).add(f)


def test_duplicate_chunk_is_refused():
    f = frame()
    assembler = BlockAssembler(frame(tensor_count=2))
    g = frame(tensor_count=2)
    assembler.add(g)
    with pytest.raises(FrameError, match="twice"):
        assembler.add(g)
    assert f.dtype == "float32" and np.frombuffer(f.data, np.float32).size == 4
