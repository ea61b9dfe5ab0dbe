"""What the ring holds, described for the prefix cache — its token ids and the layout of its prefills —
and the saving of this rank's shard of it, written on a thread of its own so an answer never waits."""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from cpchat.core.sharding import Shares
from cpchat.core.stages import common_cuts
from cpchat.rank.kvstore import KVShard
from cpchat.rank.prefix_cache import (
    CacheMiss,
    Entry,
    Found,
    Layers,
    Layout,
    PrefixStore,
    layers_of,
    prefix_id,
)
from cpchat.rank.prefix_shard import capture
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Ring


def _covers(new: dict, old: dict) -> bool:
    """Whether a new save serves every cut the old one served (so the old file can go)."""
    return new["floor"] <= old["floor"] and set(old["state_positions"]) <= set(new["state_positions"])


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _covered(ranges: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    """Whether the layer ranges together hold every layer of `span`."""
    reached = span[0]
    for first, end in sorted(ranges):
        if first <= reached < end:
            reached = end
    return reached >= span[1]


def _joined(parts: list[Found]) -> Found:
    """One shard saved in several files (stages): what all of them allow."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return Found(first.prefix_id, first.num_ranks, first.shard, min(p.tokens for p in parts),
                 min(p.common for p in parts), max(p.floor for p in parts),
                 common_cuts([p.state_positions for p in parts]))


class PrefixKeeper:
    """The ring's tokens and prefills as the prefix cache names them; `origin` is the saved prefix the
    ring's state continues, which the next save supersedes. `cache` is None under --no-cache."""

    def __init__(self) -> None:
        self.cache: PrefixStore | None = None
        self.span = (0, 0)  # the layers [first, end) this rank runs
        self.layers: Layers = None  # the same where they are a pipeline stage's (its files name them)
        self.tokens = np.zeros(0, np.uint32)
        self.segments: list[tuple[int, ...]] = []  # (start, length[, shares...]) of each prefill
        self.origin: Entry | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-writer")
        self._saves: list[Future] = []

    def forget(self, keep_tokens: int) -> None:
        self.tokens = self.tokens[:keep_tokens]
        self.segments = [s for s in self.segments if s[0] < keep_tokens]
        if self.origin is not None and self.origin.header["tokens"] > keep_tokens:
            self.origin = None

    def read_prefill(self, start: int, tokens: list[int], shares: Shares | None) -> None:
        self.tokens = np.concatenate([self.tokens, np.array(tokens, np.uint32)])
        self.segments.append((start, len(tokens), *(shares or ())))  # unequal shares hold other positions

    def read_token(self, token: int) -> None:
        self.tokens = np.append(self.tokens, np.uint32(token))

    def save(self, kv: KVShard, states: StateStore, windows: list[int | None], before_forgetting: dict,
             prompt_end: int, identity: str, model_name: str, ring: Ring) -> None:
        """Capture this rank's shard here (the MLX thread) and write it on the writer thread."""
        layout = Layout(ring.size, tuple(self.segments))
        header, arrays = capture(kv, states, self.tokens, windows, before_forgetting, prompt_end)
        header |= {"prefix_id": prefix_id(identity, layout, self.tokens), "model_key": identity,
                   "model": model_name, "num_ranks": ring.size, "shard": ring.rank,
                   "tokens": len(self.tokens), "segments": layout.segments, "saved": time.time()}
        if self.layers:
            header["layers"] = list(self.layers)
        origin = self.origin if self.origin is not None and _covers(header, self.origin.header) else None
        self.origin = Entry(self.cache.path(header["prefix_id"], ring.rank, ring.size, self.layers), header)
        self.write(header, arrays, origin)

    def write(self, header: dict, arrays: dict, replaces: Entry | None) -> None:
        """Write a file of arrays captured here on the writer thread (the draft's too: cpchat.rank.draft)."""
        self._saves = [f for f in self._saves if not f.done()]
        self._saves.append(self._writer.submit(self._write, header, arrays, replaces))

    def _write(self, header: dict, arrays: dict, replaces: Entry | None) -> None:
        try:
            self.cache.save(header, {name: np.asarray(a) for name, a in arrays.items()}, replaces)
        except OSError as e:  # a full or read-only disk costs the cache, never the answer
            print(f"cpchat rank: cannot save the prefix in {self.cache.root}: {e}", file=sys.stderr,
                  flush=True)

    def flush(self) -> None:
        """Wait for the prefix files being written."""
        for f in list(self._saves):
            f.result()

    def run_layers(self, first: int, end: int, stage: bool) -> None:
        """This rank runs layers [first, end), as a pipeline `stage` or the whole model."""
        self.span, self.layers = (first, end), (first, end) if stage else None

    def find(self, identity: str, tokens: list[int]) -> list[Found]:
        """The saved shards that begin like `tokens` (saves under way included) whose files hold every
        layer this rank runs: one Found a shard, however many files (pipeline stages) it was saved in."""
        if self.cache is None:
            return []
        self.flush()
        span = self.span
        shards: dict[tuple[str, int, int], list[Found]] = {}
        for f in self.cache.find(identity, np.array(tokens, np.uint32)):
            if _overlap(f.layers or span, span):
                shards.setdefault((f.prefix_id, f.num_ranks, f.shard), []).append(f)
        return [_joined(parts) for parts in shards.values()
                if _covered([p.layers or span for p in parts], span)]

    def load(self, prefix: str, shard: int, num_ranks: int, identity: str) -> list[tuple[dict, dict]]:
        """The files of one saved shard that hold the layers this rank runs."""
        span = self.span
        parts = [p for p in self.cache.parts(prefix, shard, num_ranks) if _overlap(p or span, span)]
        if not _covered([p or span for p in parts], span):
            raise CacheMiss(f"prefix {prefix} shard {shard} of {num_ranks}: no files hold layers "
                            f"{span[0]}-{span[1] - 1} in {self.cache.root}")
        return [self.cache.load(prefix, shard, num_ranks, identity, p) for p in parts]

    def loaded(self, prefix: str, shards: list[tuple[dict, dict]], tokens: int, ring: Ring) -> None:
        """The ring now holds saved prefix `prefix` (its `shards`, loaded), cut to `tokens`."""
        header, arrays = shards[0]
        same = header["num_ranks"] == ring.size
        self.tokens = arrays["tokens"][:tokens].copy()
        self.segments = [tuple(s) for s in header["segments"] if s[0] < tokens] if same else [(0, tokens)]
        same = same and len(shards) == 1 and layers_of(header) == self.layers
        own = Entry(self.cache.path(prefix, ring.rank, header["num_ranks"], self.layers), header)
        self.origin = own if same and header["tokens"] == tokens else None
