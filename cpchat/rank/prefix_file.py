"""One file of the prefix cache: a JSON header and raw arrays, with a SHA-256 of the arrays.

    b"CPCHATKV" | format version (u32) | header length (u64) | header (JSON) | arrays

The header names each array's dtype, shape and offset, and the arrays' length and digest. A reader
that finds anything amiss (another version, a short file, a wrong digest) raises CorruptFile; the
cache then removes the file and prefills. Writes go to a temporary file renamed into place, so a
reader sees a whole file or none, and two writers of one name leave one whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"CPCHATKV"
VERSION = 2  # 2: quantized K/V (the header says "quantized")
_PREAMBLE = struct.Struct("<8sIQ")
_MAX_HEADER = 64 << 20


class CorruptFile(Exception):
    pass


def write(path: Path, header: dict, arrays: dict[str, np.ndarray]) -> int:
    """Write atomically, user-only (0600); returns the file's size. Arrays are copied one at a time
    (a shard's may be views into larger buffers), and the digest, of fixed length, filled in last."""
    index, offset = {}, 0
    for name, a in arrays.items():
        index[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset}
        offset += a.nbytes

    def body(sha256: str) -> bytes:
        return json.dumps({**header, "arrays": index, "length": offset, "sha256": sha256}).encode()

    digest, size = hashlib.sha256(), len(body("0" * 64))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=path.suffix)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(_PREAMBLE.size + size)
            for a in arrays.values():
                data = memoryview(np.ascontiguousarray(a)).cast("B")
                digest.update(data)
                f.write(data)
            f.seek(0)
            f.write(_PREAMBLE.pack(MAGIC, VERSION, size))
            f.write(body(digest.hexdigest()))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return _PREAMBLE.size + size + offset


def read_header(path: Path) -> dict:
    """The header alone (cheap: no array is read or checked)."""
    with open(path, "rb") as f:
        return _header(f, path)


def read_array(path: Path, header: dict, name: str) -> np.ndarray:
    """One array, unchecked (e.g. the token ids, to match prefixes before loading anything)."""
    spec = header["arrays"][name]
    dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
    with open(path, "rb") as f:
        f.seek(header["data_start"] + spec["offset"])
        data = f.read(int(np.prod(shape)) * dtype.itemsize)
    if len(data) != int(np.prod(shape)) * dtype.itemsize:
        raise CorruptFile(f"{path.name}: ends inside array {name}")
    return np.frombuffer(data, dtype).reshape(shape)


def read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and every array, after checking the digest."""
    with open(path, "rb") as f:
        header = _header(f, path)
        data = f.read(header["length"] + 1)
    if len(data) != header["length"]:
        raise CorruptFile(f"{path.name}: {len(data)} bytes of arrays, the header says {header['length']}")
    if hashlib.sha256(data).hexdigest() != header["sha256"]:
        raise CorruptFile(f"{path.name}: checksum mismatch")
    arrays = {}
    for name, spec in header["arrays"].items():
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype, count, spec["offset"]).reshape(shape)
    return header, arrays


def _header(f, path: Path) -> dict:
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) != _PREAMBLE.size:
        raise CorruptFile(f"{path.name}: too short")
    magic, version, size = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise CorruptFile(f"{path.name}: not a cpchat prefix file")
    if version != VERSION:
        raise CorruptFile(f"{path.name}: format version {version}, this cpchat reads {VERSION}")
    if size > _MAX_HEADER:
        raise CorruptFile(f"{path.name}: header of {size} bytes")
    body = f.read(size)
    try:
        header = json.loads(body)
        if not isinstance(header, dict) or not isinstance(header.get("arrays"), dict):
            raise ValueError("no array index")
    except ValueError as e:
        raise CorruptFile(f"{path.name}: unreadable header ({e})") from None
    header["data_start"] = _PREAMBLE.size + size
    return header
