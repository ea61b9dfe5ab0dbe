"""What the ring holds, described for the prefix cache — its token ids and the layout of its prefills —
and the saving of this rank's shard of it, written on a thread of its own so an answer never waits."""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from cpchat.core.sharding import Shares
from cpchat.rank.kvstore import KVShard
from cpchat.rank.prefix_cache import Entry, Found, Layout, PrefixStore, prefix_id
from cpchat.rank.prefix_shard import capture
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Ring


def _covers(new: dict, old: dict) -> bool:
    """Whether a new save serves every cut the old one served (so the old file can go)."""
    return new["floor"] <= old["floor"] and set(old["state_positions"]) <= set(new["state_positions"])


class PrefixKeeper:
    """The ring's tokens and prefills as the prefix cache names them; `origin` is the saved prefix the
    ring's state continues, which the next save supersedes. `cache` is None under --no-cache."""

    def __init__(self) -> None:
        self.cache: PrefixStore | None = None
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
        origin = self.origin if self.origin is not None and _covers(header, self.origin.header) else None
        self.origin = Entry(self.cache.path(header["prefix_id"], ring.rank, ring.size), header)
        self._saves = [f for f in self._saves if not f.done()]
        self._saves.append(self._writer.submit(self._write, header, arrays, origin))

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

    def find(self, identity: str, tokens: list[int]) -> list[Found]:
        """The saved prefixes that begin like `tokens`, saves under way included."""
        if self.cache is None:
            return []
        self.flush()
        return self.cache.find(identity, np.array(tokens, np.uint32))

    def loaded(self, prefix: str, shards: list[tuple[dict, dict]], tokens: int, ring: Ring) -> None:
        """The ring now holds saved prefix `prefix` (its `shards`, loaded), cut to `tokens`."""
        header, arrays = shards[0]
        same = header["num_ranks"] == ring.size
        self.tokens = arrays["tokens"][:tokens].copy()
        self.segments = [tuple(s) for s in header["segments"] if s[0] < tokens] if same else [(0, tokens)]
        own = Entry(self.cache.path(prefix, ring.rank, header["num_ranks"]), header)
        self.origin = own if same and header["tokens"] == tokens else None
