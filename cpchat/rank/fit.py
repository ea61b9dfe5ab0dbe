"""What a model's attention needs, found out from the model itself rather than from its name.

- `cache_slots`: mlx-lm's own `make_cache()` says what each attention layer keeps — a plain
  `KVCache` (full causal attention), a `RotatingKVCache(max_size=W)` (a sliding window of W keys),
  or an `ArraysCache` (the recurrent state of a linear-attention or state-space layer, run by
  `linear_layers`); anything else is refused by name.
- `describe_layers`: one probe forward through a ring of one rank records, per layer, the query,
  key and value heads and sizes, the K/V dtype, and whether attention sinks are passed (or, for a
  linear layer, which recurrence it runs and its state's size); a layer that computes attention
  or its recurrence by itself is refused (and `RingPass.attend` refuses a mask of its own).
- `fit_rotary`: a RoPE that cannot take per-row offsets is called once per row, and one whose
  rotation depends on the sequence length (dynamic NTK) bounds the context cpchat serves exactly.
- `head_on_row`: runs the model's own `__call__` (its output path: tied or untied head, logit
  softcapping and scaling) on one row of hidden states instead of all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from cpchat.rank.kvstore import KVShard
    from cpchat.rank.statestore import StateStore


class UnsupportedModel(ValueError):
    """The model needs something cpchat's ring cannot give exactly; the message says what."""


@dataclass(frozen=True)
class CacheSlot:
    window: int | None  # keys with q_pos - k_pos < window are visible; None: every earlier key
    state: bool = False  # a linear layer's recurrent state, not keys and values


@dataclass(frozen=True)
class AttentionCall:
    """What one layer handed to scaled_dot_product_attention in the probe forward."""

    layer: int
    query_heads: int
    sinks: bool


@dataclass(frozen=True)
class LayerAttention:
    window: int | None
    query_heads: int
    key_heads: int
    key_dim: int
    value_dim: int
    dtype_bytes: int
    sinks: bool


@dataclass(frozen=True)
class LayerRecurrence:
    """A linear-attention or state-space layer: the recurrence it runs and what it keeps."""

    recurrence: str
    state_bytes: int  # its recurrent state and convolution halo, for the whole conversation
    window = None  # sees every earlier token (through its state)


@dataclass(frozen=True)
class LayerElsewhere:
    """A layer another pipeline stage runs (cpchat.rank.stages): nothing of it is held here."""

    window = None


@dataclass
class ProbeResult:
    slots: list[CacheSlot]
    calls: list[AttentionCall]
    kv: KVShard
    recurrences: list[tuple[int, str]]
    states: StateStore


def model_name(model: nn.Module) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def cache_slots(model: nn.Module) -> list[CacheSlot]:
    """One slot per cache the model's layers use, in the order the model takes them."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if not hasattr(model, "make_cache"):
        return [CacheSlot(None) for _ in model.layers]
    slots = []
    for i, cache in enumerate(model.make_cache()):
        if type(cache) is KVCache:
            slots.append(CacheSlot(None))
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            slots.append(CacheSlot(int(cache.max_size)))
        elif isinstance(cache, ArraysCache):
            slots.append(CacheSlot(None, state=True))
        else:
            layer = type(model.layers[i]).__name__ if i < len(model.layers) else f"cache {i}"
            raise UnsupportedModel(
                f"{model_name(model)}: layer {i} ({layer}) keeps its state in {type(cache).__name__}, not as "
                "keys and values or a recurrent state cpchat can run across ranks (chunked and sink-keeping "
                "caches are not supported yet)"
            )
    if all(slot.state for slot in slots):
        raise UnsupportedModel(f"{model_name(model)}: no layer attends over keys and values; cpchat runs "
                               "hybrids of linear and softmax attention, not models of recurrent layers only")
    return slots


class PerRowRope:
    """Mixed into a RoPE class that takes only a scalar offset: one call per row of a batch."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        rotate = super().__call__
        if isinstance(offset, mx.array) and offset.size > 1:
            return mx.concatenate([rotate(x[i : i + 1], o) for i, o in enumerate(offset.tolist())], axis=0)
        return rotate(x, offset)


def _rotates_rows(rope: nn.Module, dims: int) -> bool:
    try:
        mx.eval(rope(mx.ones((2, 1, 3, dims)), offset=mx.array([0, 3])))
        return True
    except Exception:  # noqa: BLE001 - whatever it raises, it cannot
        return False


def _length_free(rope: nn.Module, dims: int, position: int) -> bool:
    """Does the token at `position` rotate the same alone as with another token after it?"""
    x = mx.random.normal((1, 1, 2, dims), key=mx.random.key(0))
    pair, alone = rope(x, offset=position)[..., :1, :], rope(x[..., :1, :], offset=position)
    return mx.allclose(pair, alone, rtol=1e-5, atol=1e-5).item()


def fit_rotary(model: nn.Module, max_positions: int) -> int | None:
    """Make every RoPE of the model take per-row offsets; the number of tokens up to which all of
    them rotate a token the same whatever the length of the block it comes in (None: any number).
    Past that, mlx-lm's own answer depends on how it cuts the prompt, so there is nothing exact to give."""
    limit = None
    ropes = {id(m.rope): m.rope for _, m in model.named_modules()
             if isinstance(getattr(m, "rope", None), nn.Module)}
    for rope in ropes.values():
        dims = getattr(rope, "dims", None)
        if not isinstance(dims, int):
            continue
        if not _rotates_rows(rope, dims):
            mix_in(rope, PerRowRope)
        far = 4 * max_positions or 1 << 20
        if not _length_free(rope, dims, far):
            if not max_positions or not _length_free(rope, dims, max_positions - 2):
                raise UnsupportedModel(f"{model_name(model)}: its RoPE ({type(rope).__name__}) rotates a "
                                       "token differently depending on the length of the sequence")
            limit = max_positions
    return limit


def usable_context(config: dict) -> int:
    """The tokens the model was made to attend over (0: its config does not say): the trained
    positions, or what its RoPE scaling stretches them to (YaRN, linear, dynamic: factor times
    the original length). Llama 3 and LongRoPE configs already give the stretched length."""
    config = {**config.get("text_config", {}), **config}
    trained = next((int(config[k]) for k in ("max_position_embeddings", "max_sequence_length", "n_positions",
                                              "seq_length", "n_ctx") if config.get(k)), 0)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or ""
    factor = float(scaling.get("factor") or 1)
    if kind in ("yarn", "linear", "dynamic") and factor > 1:
        original = int(scaling.get("original_max_position_embeddings") or trained)
        return max(trained, int(factor * original))
    return trained


_mixed: dict[tuple[type, type], type] = {}


def mix_in(module: nn.Module, mixin: type) -> None:
    """Give one module a subclass of its own class with `mixin` first: the mixin's methods run and
    reach the model's own through super(); parameters and state stay where they are."""
    cls = type(module)
    if not issubclass(cls, mixin):
        module.__class__ = _mixed.setdefault((mixin, cls), type(cls.__name__, (mixin, cls), {}))


Layer = LayerAttention | LayerRecurrence | LayerElsewhere


def describe_layers(model: nn.Module, probe: ProbeResult, runs: range | None = None) -> list[Layer]:
    """Each layer's needs, as the probe saw them; those outside `runs` (another stage's) as elsewhere."""
    layers: list[Layer] = []
    for i, slot in enumerate(probe.slots):
        if runs is not None and i not in runs:
            layers.append(LayerElsewhere())
            continue
        if slot.state:
            layers.append(_describe_recurrence(model, probe, i))
            continue
        calls = [c for c in probe.calls if c.layer == i]
        keys, values, _ = probe.kv.layer(i)
        if not calls or keys is None:
            raise UnsupportedModel(f"{model_name(model)}: layer {i} computes attention without mlx-lm's "
                                   "scaled_dot_product_attention, so it cannot be routed through the ring")
        if len(calls) > 1:
            raise UnsupportedModel(f"{model_name(model)}: layer {i} attends {len(calls)} times in a forward")
        call = calls[0]
        layers.append(LayerAttention(
            window=slot.window, query_heads=call.query_heads, key_heads=keys.shape[1],
            key_dim=keys.shape[3], value_dim=values.shape[3], dtype_bytes=keys.dtype.size, sinks=call.sinks,
        ))
    return layers


def _describe_recurrence(model: nn.Module, probe: ProbeResult, i: int) -> LayerRecurrence:
    runs = [name for layer, name in probe.recurrences if layer == i]
    if len(runs) != 1:
        raise UnsupportedModel(f"{model_name(model)}: layer {i} keeps a recurrent state but "
                               + ("runs its recurrence outside mlx-lm's gated_delta_update and ssm_update"
                                  if not runs else f"runs {len(runs)} recurrences in a forward"))
    state = probe.states.layers[i]
    return LayerRecurrence(runs[0], state.state.nbytes + state.halo.nbytes)


def _inner_name(model: nn.Module) -> str:
    """The child module that runs the layers (model.model, model.transformer, ...)."""
    first = model.layers[0]  # `model.layers` may be a new list (a pipeline slice) of the same layers
    for name, child in model.children().items():
        if isinstance(child, nn.Module) and any(layer is first for layer in getattr(child, "layers", ())):
            return name
    raise UnsupportedModel(f"{model_name(model)}: cannot find the module that runs the layers")


class _OneRow:
    """Stands in for the inner model: runs it, and hands the head one flattened row (or a slice of them)."""

    def __init__(self, inner: nn.Module, row: int | slice) -> None:
        self.inner, self.rows = inner, row if isinstance(row, slice) else slice(row, row + 1)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # the head may read it (tied embeddings)

    def __call__(self, *args, **kwargs) -> mx.array:
        hidden = self.inner(*args, **kwargs)
        return hidden.reshape(-1, hidden.shape[-1])[self.rows][None]


@contextlib.contextmanager
def head_on_row(model: nn.Module, row: int | slice):
    """Within this block, `model(ids, cache=...)` returns logits [1, n, vocab] for one flattened row (or
    the n of a slice): the inner model is shadowed by an instance attribute (MLX keeps child modules as
    dict items)."""
    name = _inner_name(model)
    object.__setattr__(model, name, _OneRow(model[name], row))
    try:
        yield
    finally:
        object.__delattr__(model, name)
