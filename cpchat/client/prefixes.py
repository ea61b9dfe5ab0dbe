"""Which saved prefix a turn reuses: the longest one every rank can load (cpchat/rank/prefix_cache.py
keeps them, one shard per rank on its own disk)."""

from __future__ import annotations

from dataclasses import dataclass

from cpchat.core.stages import common_cuts

MIN_GAIN = 32  # tokens a saved prefix must add to what the ring holds to be worth loading


@dataclass(frozen=True)
class SavedPrefix:
    """A saved shard, as one rank reports it (FindPrefixes)."""

    prefix_id: str
    num_ranks: int  # of the ring that saved it
    shard: int
    tokens: int
    common: int  # of its tokens, how many begin the turn's
    floor: int  # the shortest cut it can be loaded at
    state_positions: tuple[int, ...]  # the only cuts, for a model with linear layers; empty: any


class PrefixGone(Exception):
    """A rank no longer had the chosen prefix (evicted, or its file was unreadable and removed)."""


@dataclass(frozen=True)
class PrefixLoaded:
    keep_floor: int  # as after a generation: a later turn keeps at least this many tokens, or none
    state_positions: tuple[int, ...]


@dataclass(frozen=True)
class PrefixChoice:
    prefix_id: str
    num_ranks: int
    tokens: int  # the cut: tokens loaded

    def resharded(self, ring_size: int) -> bool:
        return self.num_ranks != ring_size


def choose_prefix(found: list[list[SavedPrefix]], limit: int, held: int = 0,
                  ring_size: int = 0) -> PrefixChoice | None:
    """The longest cut, at most `limit` tokens and MIN_GAIN past `held`, that every rank can load:
    `found[r]` is what rank r holds (of its layers: a pipeline stage's). A prefix saved by a ring of
    `ring_size` (default: every rank; with stages, a stage's) needs each rank's own shard, rank r's
    being r % ring_size; one of another size needs every shard on every rank's disk (one host: they
    re-shard)."""
    ring_size = ring_size or len(found)
    shards: dict[tuple[str, int], list[dict[int, SavedPrefix]]] = {}
    for rank, saved in enumerate(found):
        for s in saved:
            shards.setdefault((s.prefix_id, s.num_ranks), [{} for _ in found])[rank][s.shard] = s
    best: tuple[int, bool, PrefixChoice] | None = None
    for (prefix_id, num_ranks), by_rank in shards.items():
        same = num_ranks == ring_size
        needed = [[rank % ring_size] if same else range(num_ranks) for rank in range(len(found))]
        if any(s not in have for have, need in zip(by_rank, needed, strict=True) for s in need):
            continue
        usable = [have[s] for have, need in zip(by_rank, needed, strict=True) for s in need]
        top, floor = min(min(s.common for s in usable), limit), max(s.floor for s in usable)
        constrained = any(s.state_positions for s in usable)  # linear layers' cuts
        cuts = common_cuts([s.state_positions for s in usable]) if constrained else (top,)
        cut = max((c for c in cuts if floor <= c <= top), default=0)
        if cut >= held + MIN_GAIN and (best is None or (cut, same) > best[:2]):
            best = (cut, same, PrefixChoice(prefix_id, num_ranks, cut))
    return best[2] if best else None
