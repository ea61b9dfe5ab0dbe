"""Pipeline stages: the model's layers split into P contiguous ranges, each run by one stage of C
context ranks (ranks s*C .. s*C + C - 1 form stage s's ring). A rank holds only its stage's layers
(stage 0 also the embedding, the last stage the final norm and the output head), and rank (s, c)
hands the hidden states of its rows to rank (s + 1, c), which holds the same tokens: no re-sharding.

The model still runs its own `__call__` on every stage: the layers another stage runs pass their
input through, the stage's first layer takes the previous stage's hidden states instead of its
input, and its last one hands its output on and ends the forward (`StageEnd`) on every stage but
the last.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from cpchat.core.stages import WEIGHT_SHARE, WeightParts, even_split
from cpchat.format import human_bytes
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.fit import UnsupportedModel, mix_in, model_name
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey

EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)


class StagesRefused(ValueError):
    """The model cannot be split as asked; the message says why."""


@dataclass(frozen=True)
class StagePlace:
    """Where a rank sits: stage `stage` of `stages`, running layers [first, end) with its `ring_size`
    context ranks."""

    stage: int = 0
    stages: int = 1
    ring_size: int = 0  # 0: every rank of the ring (one stage)
    first: int = 0
    end: int = 0

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def runs(self, layer: int) -> bool:
        return self.first <= layer < self.end

    def world_rank(self, stage: int, context_rank: int) -> int:
        return stage * self.ring_size + context_rank


def split_layers(layers: int, stages: int, counts: tuple[int, ...] = ()) -> list[int]:
    """Layers per stage: `counts` as given, or an even split (the first stages take one more)."""
    if counts:
        if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
            raise StagesRefused(f"layer counts {','.join(map(str, counts))} do not split the model's "
                                f"{layers} layers into {stages} stages")
        return list(counts)
    if not 1 <= stages <= layers:
        raise StagesRefused(f"{stages} stages for a model of {layers} layers: at most one stage a layer")
    return even_split(layers, stages)


def place_of(rank: int, ranks: int, layers: int, stages: int, counts: tuple[int, ...] = ()) -> StagePlace:
    """Rank `rank` of `ranks`'s place when they form `stages` stages."""
    if stages < 1 or ranks % stages:
        raise StagesRefused(f"{ranks} ranks do not form {stages} stages of equal size")
    split = split_layers(layers, stages, counts)
    size = ranks // stages
    stage = rank // size
    first = sum(split[:stage])
    return StagePlace(stage, stages, size, first, first + split[stage])


def one_stage(layers: int) -> StagePlace:
    return StagePlace(0, 1, 0, 0, layers)


# ---- the ring of a stage


class StageRing(Ring):
    """A stage's context ring: its ranks numbered 0..C-1, over the whole ring's links and mailbox."""

    def __init__(self, world: Ring, place: StagePlace) -> None:
        self.offset = place.world_rank(place.stage, 0)
        size = place.ring_size
        links = {c: world.links[self.offset + c] for c in range(size) if self.offset + c != world.rank}
        super().__init__(world.rank - self.offset, size, links, world.mailbox)

    def take(self, key: BlockKey, abort: threading.Event, source: int | None = None
             ) -> tuple[list[mx.array], float]:
        source = self.prev_rank if source is None else source
        return super().take(key, abort, self.offset + source)


def context_ring(world: Ring, place: StagePlace) -> Ring:
    return world if place.stages == 1 else StageRing(world, place)


# ---- hidden states between stages


class StageEnd(Exception):  # noqa: N818 - not an error: the forward of a stage but the last ends here
    """Raised by a stage's last layer once its output is handed on."""


@dataclass
class Handoff:
    """One forward's hidden states: taken from the previous stage, handed to the next."""

    world: Ring
    place: StagePlace
    request_id: str
    step: int  # the forward's first global position: tells the passes and tokens of a request apart
    abort: threading.Event
    context_rank: int  # whose rows: the same on both sides
    waits: list[float]  # each receive's wait for the previous stage, in seconds

    def receive(self, x: mx.array) -> mx.array:
        if self.place.first_stage:
            return x
        source = self.place.world_rank(self.place.stage - 1, self.context_rank)
        (hidden,), waited = self.world.take(self._key(self.place.first), self.abort, source)
        self.waits.append(waited)
        return hidden

    def hand_on(self, hidden: mx.array) -> None:
        if not self.place.last_stage:
            to = self.place.world_rank(self.place.stage + 1, self.context_rank)
            self.world.send(self._key(self.place.end), [hidden], to=to)

    def _key(self, layer: int) -> BlockKey:
        return BlockKey(self.request_id, layer, self.step % (1 << 32), pb.HIDDEN)


_current = threading.local()


@contextlib.contextmanager
def handing(handoff: Handoff | None) -> Iterator[None]:
    """Within this block the stage's first and last layers take and hand on through `handoff`."""
    _current.handoff = handoff
    try:
        yield
    finally:
        _current.handoff = None


def _handoff() -> Handoff | None:
    return getattr(_current, "handoff", None)


class PassThrough:
    """A layer another stage runs: its input goes on unchanged."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return x


class TakesHidden:
    """A stage's first layer: it runs on the previous stage's hidden states."""

    def __call__(self, x: mx.array, *args, **kwargs):
        handoff = _handoff()
        return super().__call__(handoff.receive(x) if handoff else x, *args, **kwargs)


class HandsOnHidden:
    """A stage's last layer: its output goes to the next stage, and this stage's forward ends
    (`StageEnd`) unless it is the last stage."""

    last_stage = True

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if not isinstance(out, mx.array):
            raise UnsupportedModel(f"its layers return {type(out).__name__}, not one array of hidden states "
                                   "a stage could hand on")
        handoff = _handoff()
        if handoff is not None:
            handoff.hand_on(out)
        if not self.last_stage:
            raise StageEnd
        return out


class NoEmbedding:
    """A stage after the first holds no embedding: zeros of the right shape stand in for its
    output, which the stage's first layer replaces."""

    width = 0

    def __call__(self, x: mx.array) -> mx.array:
        return mx.zeros((*x.shape, self.width), mx.float32)


def _outside_layers(model: nn.Module) -> tuple[set[int], list[nn.Module], bool]:
    """The ids of the modules inside the layers, the embeddings outside them, and whether the output
    head is the embedding (no linear layer outside the layers)."""
    in_layers = {id(m) for layer in model.layers for _, m in layer.named_modules()}
    embeddings = [m for _, m in model.named_modules() if isinstance(m, EMBEDDINGS) and id(m) not in in_layers]
    tied = not any(isinstance(m, (nn.Linear, nn.QuantizedLinear)) and id(m) not in in_layers
                   for _, m in model.named_modules())
    return in_layers, embeddings, tied


def weight_parts(model: nn.Module) -> WeightParts:
    _, embeddings, tied = _outside_layers(model)
    layers = [_nbytes(layer) for layer in model.layers]
    embedding = sum(_nbytes(e) for e in embeddings)
    return WeightParts(layers, embedding, _nbytes(model) - sum(layers) - embedding, tied)


def fewest_holding(parts: WeightParts, free: int, ranks: int) -> int | None:
    """The fewest stages of `ranks` ranks in which every rank's weights take at most WEIGHT_SHARE of
    `free` (None: no split does)."""
    for stages in (p for p in range(1, ranks + 1) if ranks % p == 0 and p <= len(parts.layers)):
        places = [place_of(r, ranks, len(parts.layers), stages) for r in range(0, ranks, ranks // stages)]
        if max(_held(parts, p) for p in places) <= WEIGHT_SHARE * free:
            return stages
    return None


def check_weights_fit(parts: WeightParts, place: StagePlace, free: int, name: str) -> None:
    """Refuse, before any weight is read, a stage whose weights exceed what this rank may hold."""
    held = _held(parts, place)
    if held <= free:
        return
    which = f"layers {place.first}-{place.end - 1} of " if place.stages > 1 else ""
    ranks = place.stages * place.ring_size
    fits = fewest_holding(parts, free, ranks) if ranks else None
    hint = f"--stages {fits} would hold them" if fits else f"no split of {ranks} ranks like it holds them"
    raise StagesRefused(f"the weights of {which}{name} take {human_bytes(held)} but this rank may hold "
                        f"{human_bytes(free)}: {hint}")


def _held(parts: WeightParts, place: StagePlace) -> int:
    return parts.stage_bytes(place.first, place.end, place.stage, place.stages)


def _nbytes(module: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def keep_stage(model: nn.Module, place: StagePlace) -> None:
    """Make `model` (loaded lazily, nothing evaluated) run only its stage; the weights it does not run
    are dropped before anything is read, so only the stage's ever reach memory (WeightParts.stage_bytes)."""
    if place.stages == 1:
        return
    layers = model.layers
    if len({id(layer) for layer in layers}) != len(layers):
        raise StagesRefused(f"{model_name(model)}: its layers share weights (one layer runs at several "
                            "depths), so they cannot be split into stages")
    in_layers, embeddings, tied = _outside_layers(model)
    ran = {id(a) for i in range(place.first, place.end) for _, a in tree_flatten(layers[i].parameters())}
    for i, layer in enumerate(layers):
        if not place.runs(i):
            shared = [name for name, a in tree_flatten(layer.parameters()) if id(a) in ran]
            if shared:
                raise StagesRefused(f"{model_name(model)}: layers {place.first}-{place.end - 1} share "
                                    f"{shared[0]} with layer {i}, so they cannot be split into stages there")
            _drop(layer)
            mix_in(layer, PassThrough)
    mix_in(layers[place.first], TakesHidden)
    mix_in(layers[place.end - 1], HandsOnHidden)
    layers[place.end - 1].last_stage = place.last_stage
    kept = {id(a) for i in range(place.first, place.end) for _, a in tree_flatten(layers[i].parameters())}
    for embedding in embeddings:
        if place.first_stage or (place.last_stage and tied):
            kept.update(id(a) for _, a in tree_flatten(embedding.parameters()))
        else:
            width = embedding(mx.array([[0]])).shape[-1]  # a shape, from the lazy weights: nothing is read
            _drop(embedding)
            mix_in(embedding, NoEmbedding)
            embedding.width = width
    if not place.last_stage:
        flat = tree_flatten(model.parameters())
        model.update(tree_unflatten([(name, a if id(a) in kept or not a.size else _empty(a))
                                     for name, a in flat]))


def elsewhere(model: nn.Module) -> frozenset[int]:
    """The layers of `model` another stage runs."""
    return frozenset(i for i, layer in enumerate(model.layers) if isinstance(layer, PassThrough))


def _drop(module: nn.Module) -> None:
    """Replace every weight of `module` with an empty array (the lazily loaded one is never read)."""
    module.update(tree_unflatten([(name, _empty(a)) for name, a in tree_flatten(module.parameters())]))


def _empty(a: mx.array) -> mx.array:
    return mx.zeros((0,), a.dtype)

