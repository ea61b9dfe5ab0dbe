"""PrefixStore: the saved conversation states on this rank's disk, one file per rank's shard.

A saved prefix is named by `prefix_id`: a hash of the model's identity, the token ids, the ring
size and the layout (which global positions each rank held), and the file format. So a file can only
be found by a ring that would compute the same keys and values, and every rank of one ring names
its shard of one state alike: `<prefix_id>-<shard>-of-<num_ranks>.kvp`; a rank of a pipeline stage
(cpchat/rank/stages.py) saves its layers' part of its shard, `...-of-<num_ranks>-layers-<first>-<end>.kvp`,
and a rank of any split loads its layers from the parts that hold them. The rank derives every
path itself; a client passes a prefix id, which must be 32 hex digits.

Files that cannot be read are removed, never loaded (cpchat/rank/prefix_file.py checks them).
The store is bounded per shard index: after a write, the least recently used files of that index
go until the rest fit `max_bytes`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpchat.rank import prefix_file
from cpchat.rank.prefix_file import CorruptFile

SUFFIX = ".kvp"
_NAME = re.compile(r"^([0-9a-f]{32})-(\d+)-of-(\d+)(?:-layers-(\d+)-(\d+))?\.kvp$")
Layers = tuple[int, int] | None  # a file's layers [first, end); None: every layer
FIELDS = ("prefix_id", "model_key", "model", "num_ranks", "shard", "tokens", "segments", "floor",
          "state_positions", "dtypes", "quantized")  # every header has them (cpchat/rank/engine.py writes)


class CacheMiss(Exception):
    """The saved prefix asked for is not (or no longer) here, or cannot be read."""


@dataclass(frozen=True)
class Layout:
    """Which global positions each rank of a ring holds: prefills (start, length[, shares...]) are
    sharded head-tail in those shares (cpchat.core.sharding; equal if none), and each position outside
    them (a decoded token) by the decode round robin."""

    num_ranks: int
    segments: tuple[tuple[int, ...], ...]

    def cut(self, tokens: int) -> Layout:
        return Layout(self.num_ranks, tuple(s for s in self.segments if s[0] < tokens))


def prefix_id(model_key: str, layout: Layout, tokens: np.ndarray) -> str:
    key = {"format": prefix_file.VERSION, "model": model_key, "ranks": layout.num_ranks,
           "segments": layout.cut(len(tokens)).segments,
           "tokens": hashlib.sha256(np.asarray(tokens, np.uint32).tobytes()).hexdigest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens two sequences of token ids share from their start."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def model_identity(model_dir: Path, settings: dict) -> str:
    """A hash of the model's files (name, size, modification time; config.json's content) and of the
    settings its keys and values depend on (dtype, device): a rewritten weights file changes it."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        stat = path.stat()  # of a hub snapshot's symlink target: the blob
        digest.update(f"{path.relative_to(model_dir)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        if path.name == "config.json":
            digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Found:
    """A saved shard that begins like the request's tokens."""

    prefix_id: str
    num_ranks: int
    shard: int
    tokens: int  # the saved prefix's length
    common: int  # of them, how many begin the request's tokens
    floor: int  # the shortest cut this shard can be loaded at (sliding-window layers forgot keys)
    state_positions: tuple[int, ...]  # where linear layers' states were saved; empty: any cut
    layers: Layers = None  # the layers the file holds (a pipeline stage's)


@dataclass(frozen=True)
class Entry:
    path: Path
    header: dict

    @property
    def shard(self) -> int:
        return self.header["shard"]

    @property
    def size(self) -> int:
        return self.path.stat().st_size


class PrefixStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self._headers: dict[Path, tuple[tuple[int, int], dict]] = {}  # by (mtime_ns, size)

    def path(self, prefix: str, shard: int, num_ranks: int, layers: Layers = None) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", prefix):
            raise CacheMiss(f"{prefix!r} is not a prefix id")
        part = f"-layers-{layers[0]}-{layers[1]}" if layers else ""
        return self.root / f"{prefix}-{shard}-of-{num_ranks}{part}{SUFFIX}"

    def parts(self, prefix: str, shard: int, num_ranks: int) -> list[Layers]:
        """The layer ranges of the files of one shard here: [None] for one file of every layer."""
        if not self.root.is_dir():
            return []
        name = self.path(prefix, shard, num_ranks).name.removesuffix(SUFFIX)
        found = [_NAME.match(p.name) for p in self.root.glob(f"{name}*{SUFFIX}")]
        return [(int(m[4]), int(m[5])) if m[4] else None for m in found
                if m and (int(m[2]), int(m[3])) == (shard, num_ranks)]

    def entries(self, model_key: str | None = None) -> list[Entry]:
        """Every readable file here (of one model); unreadable ones are removed."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            if not _NAME.match(path.name):
                continue
            try:
                header = self._header(path)
            except FileNotFoundError:
                continue
            except (CorruptFile, OSError):
                self.discard(path)
                continue
            if model_key is None or header["model_key"] == model_key:
                found.append(Entry(path, header))
        return found

    def find(self, model_key: str, tokens: np.ndarray) -> list[Found]:
        found = []
        for entry in self.entries(model_key):
            h = entry.header
            try:
                saved = prefix_file.read_array(entry.path, h, "tokens")
            except (CorruptFile, OSError, KeyError, TypeError, ValueError):  # no readable token ids
                self.discard(entry.path)
                continue
            common = shared_length(saved, tokens)
            if common:
                found.append(Found(h["prefix_id"], h["num_ranks"], h["shard"], len(saved), common,
                                   h["floor"], tuple(h["state_positions"]), layers_of(h)))
        return found

    def save(self, header: dict, arrays: dict[str, np.ndarray], replaces: Entry | None = None) -> Path:
        """Write one shard, drop the file it supersedes (`replaces`), then evict to the bound."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(header["prefix_id"], header["shard"], header["num_ranks"], layers_of(header))
        prefix_file.write(path, header, arrays)
        if replaces is not None and replaces.path != path:
            replaces.path.unlink(missing_ok=True)
        self.evict(header["shard"], keep=path)
        return path

    def load(self, prefix: str, shard: int, num_ranks: int, model_key: str,
             layers: Layers = None) -> tuple[dict, dict[str, np.ndarray]]:
        path = self.path(prefix, shard, num_ranks, layers)
        try:
            header, arrays = prefix_file.read(path)
        except FileNotFoundError:
            raise CacheMiss(f"prefix {prefix} shard {shard} of {num_ranks} is not in {self.root}") from None
        except (CorruptFile, OSError) as e:
            self.discard(path)
            raise CacheMiss(f"removed an unreadable prefix file: {e}") from None
        if header.get("model_key") != model_key or header.get("prefix_id") != prefix:
            self.discard(path)
            raise CacheMiss(f"removed {path.name}: it was saved for another model or prefix")
        os.utime(path)  # last used, for eviction
        return header, arrays

    def evict(self, shard: int, keep: Path | None = None) -> None:
        """Remove this shard index's least recently used files (not `keep`) until the rest fit."""
        mine = []
        for e in self.entries():
            with contextlib.suppress(FileNotFoundError):  # another rank's eviction got there first
                if e.shard == shard:
                    stat = e.path.stat()
                    mine.append((stat.st_mtime_ns, stat.st_size, e.path))
        total = sum(size for _, size, _ in mine)
        for _, size, path in sorted(mine):
            if total <= self.max_bytes:
                break
            if path != keep:
                total -= size
                self.discard(path)
        self._sweep()

    def clear(self) -> int:
        """Remove every file here; returns how many bytes they held."""
        freed = 0
        for entry in self.entries():
            with contextlib.suppress(FileNotFoundError):
                freed += entry.size
            self.discard(entry.path)
        self._sweep()
        return freed

    def _sweep(self) -> None:
        """Remove what writers that died left (temporary files more than an hour old)."""
        for stale in self.root.glob(f".writing-*{SUFFIX}") if self.root.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()

    def discard(self, path: Path) -> None:
        self._headers.pop(path, None)
        with contextlib.suppress(OSError):  # another user's file, say: left as it is, and unused
            path.unlink(missing_ok=True)

    def _header(self, path: Path) -> dict:
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        cached = self._headers.get(path)
        if cached is None or cached[0] != key:
            header = prefix_file.read_header(path)
            missing = [f for f in FIELDS if f not in header]
            if missing:
                raise CorruptFile(f"{path.name}: the header lacks {', '.join(missing)}")
            match = _NAME.match(path.name)
            named = (int(match[4]), int(match[5])) if match[4] else None
            if (header["prefix_id"], header["shard"], header["num_ranks"], layers_of(header)) != (
                    match[1], int(match[2]), int(match[3]), named):
                raise CorruptFile(f"{path.name}: the header names another shard")
            cached = self._headers[path] = (key, header)
        return cached[1]


def layers_of(header: dict) -> Layers:
    layers = header.get("layers")
    return (int(layers[0]), int(layers[1])) if layers else None
