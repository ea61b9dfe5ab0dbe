"""Linear-attention and state-space layers (Gated DeltaNet, Mamba-2) across ranks, exactly.

Such a layer projects its input, runs a short causal convolution (kernel K) over
it, and carries a recurrent state through the sequence. The model's own layer
runs unchanged; three hooks make it context-parallel:

- `StateCache` stands in for the layer's ArraysCache: it hands out no state, so
  the layer builds its convolution from zeros and passes the recurrence none.
- `HaloMixer`, mixed into every module with a Conv1d that takes a cache, puts
  in front of each row the layer inputs at the K-1 positions before it (the
  halo: from the ranks that hold them in prefill, from the `StateStore` in
  decode and across turns) and masks those that do not exist, so the
  convolution sees what it would in one sequence; it cuts them off the output.
- the recurrence itself (mlx-lm's `gated_delta_update`, `ssm_update`, as every
  model module binds it) is wrapped: in prefill each row (a chunk of the
  sequence) runs once on a stacked state that gives its output from a zero
  state and its transform (`cpchat.core.recurrence` has the math), the chunks'
  transforms are all-gathered and folded in order, and each row adds its true
  start state; in decode every rank runs the new token from the stored state,
  as mlx-lm does. Gated DeltaNet's prompt rows run chunkwise
  (`cpchat.core.gated_delta`) where mlx-lm would loop over tokens.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cpchat.core.gated_delta import chunked_gated_delta
from cpchat.core.recurrence import add_start_state, fold, stacked_start
from cpchat.core.sharding import Shares, head_tail_layout
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.fit import UnsupportedModel, mix_in
from cpchat.rank.transport.wire import BlockKey, block_nbytes

if TYPE_CHECKING:
    from cpchat.rank.context_parallel import RingPass
    from cpchat.rank.statestore import StateStore


# A linear layer's ring steps in prefill: the halo exchange, its chunks' own runs, and the state combine.
HALO_STEP, RUN_STEP, COMBINE_STEP = range(3)


def chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                               lower_bound=None, allow_neg_eigval=False):
    """mlx-lm's `gated_delta_update` over a prompt, chunkwise where mlx-lm would loop over the tokens
    (no Metal kernel) and the gate is one scalar per head."""
    from mlx_lm.models import gated_delta

    if mask is not None or (mx.default_device() == mx.gpu and mx.metal.is_available()):
        return gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask,
                                              use_kernel=use_kernel, lower_bound=lower_bound,
                                              allow_neg_eigval=allow_neg_eigval)
    beta = mx.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)  # g and beta as gated_delta_update makes them
    if lower_bound is None:
        g = gated_delta.compute_g(A_log, a, dt_bias)
    else:
        g = gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if g.ndim != 3:  # a gate per key channel
        return gated_delta.gated_delta_ops(q, k, v, g, beta, state)
    return chunked_gated_delta(q, k, v, g, beta, state)


@dataclass(frozen=True)
class Recurrence:
    """How one of mlx-lm's recurrence functions takes its arguments."""

    value: str  # the per-token input the state accumulates; zero in the state rows that find P and r
    key: str  # an argument whose last axis is the state's last (Dk)
    state: str
    mask: str
    output_like: str  # the argument whose dtype the output takes
    float32: tuple[str, ...]  # cast up so the outputs stay float32 until the start state is added
    prefill: Callable | None = None  # a faster stand-in for prompt rows, with the same signature and results


RECURRENCES = {
    "gated_delta_update": Recurrence("v", "k", "state", "mask", output_like="q", float32=("q", "k", "v"),
                                     prefill=chunked_gated_delta_update),
    "ssm_update": Recurrence("hidden_states", "B", "state", "mask", output_like="hidden_states",
                             float32=("hidden_states",)),
}


@dataclass
class _Call:
    cache: StateCache
    halo: int


_active: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("linear_layer", default=None)


class StateCache:
    """The cache object a linear layer sees: no state of its own (the hooks keep it)."""

    lengths = None

    def __init__(self, ring_pass: RingPass, layer: int) -> None:
        self.ring_pass, self.layer = ring_pass, layer

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, index: int) -> None:
        if _active.get() is None:
            raise UnsupportedModel(f"layer {self.layer} reads its recurrent state outside a module with a "
                                   "short convolution cpchat recognises")
        return None

    def __setitem__(self, index: int, value) -> None:
        pass  # the hooks store the state and the halo

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, *args, **kwargs) -> None:
        return None

    def halo_rows(self, x: mx.array, halo: int) -> tuple[mx.array, mx.array]:
        return halo_rows(self.ring_pass, self.layer, x, halo)

    def recurrence(self, name: str, original, spec: Recurrence, args: dict, halo: int):
        return run_recurrence(self.ring_pass, self.layer, name, original, spec, args, halo)


class HaloMixer:
    """Mixed into a linear layer's module: runs it over [halo, row] with the halo masked where it
    does not exist, and returns the rows' outputs only."""

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(super().__call__).bind(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if not isinstance(cache, StateCache):
            return super().__call__(*args, **kwargs)
        first = next(iter(bound.arguments))
        halo = _kernel(self) - 1
        x, mask = cache.halo_rows(bound.arguments[first], halo)
        bound.arguments[first], bound.arguments["mask"] = x, mask
        token = _active.set(_Call(cache, halo))
        try:
            out = super().__call__(*bound.args, **bound.kwargs)
        finally:
            _active.reset(token)
        return out[:, halo:]


def _kernel(module: nn.Module) -> int:
    return next(c for c in module.children().values() if isinstance(c, nn.Conv1d)).weight.shape[1]


class ShiftedConv:
    """Mixed into a depthwise Conv1d (one filter per channel, stride and dilation 1): the convolution as
    a sum of the kernel's K shifted products, which MLX's CPU runs 3-4x faster than its grouped
    convolution (8,192 channels, 2,048 tokens, K = 4: 0.25 s against 0.9 s)."""

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu:
            return super().__call__(x)
        dtype = x.dtype
        x = mx.pad(x.astype(mx.float32), [(0, 0), (self.padding, self.padding), (0, 0)])
        w = self.weight.astype(mx.float32)
        n = x.shape[1] - w.shape[1] + 1
        y = sum(x[:, j:j + n] * w[:, j, 0] for j in range(w.shape[1])).astype(dtype)
        return y + self.bias if "bias" in self else y


def adapt(model: nn.Module) -> None:
    """Mix HaloMixer into every module that runs a Conv1d child and takes a mask and a cache, and
    ShiftedConv into that child where it is depthwise."""
    for _, module in model.named_modules():
        convs = [c for c in module.children().values() if isinstance(c, nn.Conv1d)]
        params = inspect.signature(type(module).__call__).parameters
        if convs and "cache" in params and "mask" in params:
            mix_in(module, HaloMixer)
            for conv in convs:
                if conv.groups == conv.weight.shape[0] and conv.weight.shape[2] == 1 \
                        and conv.stride == conv.dilation == 1:
                    mix_in(conv, ShiftedConv)


def install() -> None:
    """Wrap mlx-lm's recurrence functions in every loaded model module that binds them. Idempotent;
    they run unchanged outside a linear layer handed a StateCache."""
    from mlx_lm.models import gated_delta, ssm

    for source in (gated_delta, ssm):
        for name in RECURRENCES:
            original = getattr(source, name, None)
            if original is None:
                continue
            hooked = _hook(name, original)
            for module_name, module in list(sys.modules.items()):
                if module_name.startswith("mlx_lm.models.") and module is not source \
                        and getattr(module, name, None) is original:
                    setattr(module, name, hooked)


def _hook(name: str, original):
    spec, signature = RECURRENCES[name], inspect.signature(original)

    def recurrence(*args, **kwargs):
        call = _active.get()
        if call is None:
            return original(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        return call.cache.recurrence(name, original, spec, arguments, call.halo)

    recurrence.__wrapped__ = original
    return recurrence


# ---- the halo


def halo_rows(rp: RingPass, layer: int, x: mx.array, halo: int) -> tuple[mx.array, mx.array]:
    """`x` [R, T, D] with each row's halo in front, and the mask of positions that exist [R, halo+T];
    stores the inputs at the last `halo` positions for the next forward."""
    if rp.decoding:
        return decode_halo_rows([rp.states], layer, x, halo)
    stored = rp.states.layer(layer, halo, x)
    rows, length, dim = x.shape
    timing = rp.step_timing(layer, HALO_STEP)
    start, end = rp.start, rp.start + rp.seq_len
    positions = rp.q_positions.reshape(rows, length)
    wanted = [list(range(p - halo, p)) for p in positions[:, 0]] + [list(range(end - halo, end))]
    found = _gather_halo(rp, layer, x.reshape(rows * length, dim), halo, timing)
    zero = mx.zeros((dim,), x.dtype)

    def vector(p: int) -> mx.array:
        if p < start:  # the previous forward's inputs (or none, before the conversation began)
            return stored.halo[0, p - (start - halo)]
        return found.get(p, zero)

    def real(p: int) -> bool:
        return stored.halo_real[p - (start - halo)] if p < start else p < end

    halos = [mx.stack([vector(p) for p in ps]) if ps else mx.zeros((0, dim), x.dtype) for ps in wanted]
    rp.states.set(layer, halo=halos[-1][None], halo_real=np.array([real(p) for p in wanted[-1]], bool))
    mask = np.array([[real(p) for p in ps] for ps in wanted[:-1]], bool).reshape(rows, halo)
    ext = mx.concatenate([mx.stack(halos[:-1]), x], axis=1)
    return ext, mx.array(np.concatenate([mask, rp.real.reshape(rows, length)], axis=1))


def decode_halo_rows(stores: list[StateStore], layer: int, x: mx.array,
                     halo: int) -> tuple[mx.array, mx.array]:
    """Decode: row b of `x` [B, T, D] after conversation b's stored halo (`stores[b]`), and the mask of
    the positions that exist; stores each conversation's new halo."""
    rows, masks = [], []
    for b, store in enumerate(stores):
        stored = store.layer(layer, halo, x)
        ext = mx.concatenate([stored.halo, x[b:b + 1]], axis=1)
        real = np.concatenate([stored.halo_real, np.ones(x.shape[1], bool)])
        store.set(layer, halo=ext[:, ext.shape[1] - halo:], halo_real=real[len(real) - halo:])
        rows.append(ext)
        masks.append(real)
    return (rows[0] if len(rows) == 1 else mx.concatenate(rows)), mx.array(np.stack(masks))


@dataclass(frozen=True)
class HaloPlan:
    """Whose inputs go where in one prefill's halo exchange (the same for every linear layer)."""

    sends: tuple[tuple[int, tuple[int, ...]], ...]  # (rank, this rank's flattened row indices it needs)
    takes: tuple[tuple[int, tuple[int, ...]], ...]  # (rank, the positions it sends here)
    local: tuple[tuple[int, int], ...]  # (position, flattened row index) this rank needs from itself


@functools.lru_cache(maxsize=16)
def halo_plan(start: int, n: int, size: int, me: int, halo: int, shares: Shares | None = None) -> HaloPlan:
    """The exchange for a prompt of `n` tokens from `start` over `size` ranks: each rank needs the inputs
    at the `halo` positions before each of its rows, and at the last `halo` of the prompt."""

    def needs(rank: int) -> set[int]:
        firsts = [*head_tail_layout(n, size, rank, shares).starts, n]
        return {start + p for s in firsts for p in range(max(s - halo, 0), min(s, n))}

    def held(rank: int) -> dict[int, int]:
        positions = head_tail_layout(n, size, rank, shares).positions()
        return {start + p: i for i, p in enumerate(positions) if p < n}

    mine, wanted = held(me), needs(me)
    peers = [r for r in range(size) if r != me]
    sends = ((r, tuple(mine[p] for p in sorted(needs(r) & mine.keys()))) for r in peers)
    takes = ((r, tuple(sorted(wanted & held(r).keys()))) for r in peers)
    return HaloPlan(tuple((r, i) for r, i in sends if i), tuple((r, p) for r, p in takes if p),
                    tuple((p, mine[p]) for p in sorted(wanted & mine.keys())))


def _gather_halo(rp: RingPass, layer: int, flat: mx.array, halo: int, timing) -> dict[int, mx.array]:
    """The inputs at every prompt position this rank's halos need, from itself and from the ranks that
    hold them."""
    plan = halo_plan(rp.start, rp.seq_len, rp.ring.size, rp.ring.rank, halo, rp.shares)
    key = BlockKey(rp.request_id, layer, 0, pb.HALO)
    for rank, rows in plan.sends:
        block = [flat[mx.array(rows)]]
        rp.ring.send_all(key, block, [rank])
        timing.bytes_sent += block_nbytes(block)
    found = {p: flat[i] for p, i in plan.local}
    for rank, positions in plan.takes:
        (block,), waited = rp.ring.take(key, rp.abort, rank)
        timing.wait_ms += 1000 * waited
        found.update(zip(positions, block))
    return found


# ---- the recurrence


def run_recurrence(rp: RingPass, layer: int, name: str, original, spec: Recurrence, args: dict, halo: int):
    """The layer's recurrence over this rank's rows (the halo positions skipped), as over one sequence."""
    rp.recurrences.append((layer, name))
    if rp.decoding:
        return decode_recurrence([rp.states], layer, original, spec, args, halo)
    value = args[spec.value]
    rows, total = value.shape[:2]
    args = _per_token(args, rows, total, lambda a: a[:, halo:])
    args[spec.mask] = None  # positions past the prompt are cut off each row instead
    stored = rp.states.layers[layer]
    timing = rp.step_timing(layer, RUN_STEP)
    t0 = time.perf_counter()
    length = total - halo
    real = rp.real.reshape(rows, length).sum(axis=1).tolist()
    chunks = [rp.ring.rank, 2 * rp.ring.size - 1 - rp.ring.rank]  # the head chunk, then the tail
    runs = {}  # chunk -> (y0, r, P, Q), for rows that hold prompt tokens
    for row, (chunk, n) in enumerate(zip(chunks, real)):
        if n:
            row_args = _per_token(args, rows, length, lambda a, row=row, n=n: a[row:row + 1, :n])
            first = chunk == 0 and stored.state is None  # starts from no state: needs no P or r
            runs[chunk] = chunk_transform(spec.prefill or original, spec, row_args, first)
    mx.eval([a for run in runs.values() for a in run if a is not None])
    timing.compute_ms += 1000 * (time.perf_counter() - t0)

    timing = rp.step_timing(layer, COMBINE_STEP)
    transforms = _all_gather_transforms(rp, layer, {c: run[2:] for c, run in runs.items()}, timing)
    t0 = time.perf_counter()
    order = sorted(transforms)
    starts, final = fold(stored.state, [transforms[c] for c in order])
    start_of = dict(zip(order, starts))
    like = args[spec.output_like].dtype  # what mlx-lm's run returns
    ys = []
    for chunk in chunks:
        if chunk not in runs:  # a row past the end of the prompt
            ys.append(mx.zeros((1, total, *value.shape[2:]), like))
            continue
        y0, r = runs[chunk][:2]
        y = y0 if start_of[chunk] is None else add_start_state(y0, r, start_of[chunk])
        ys.append(mx.pad(y.astype(like), [(0, 0), (halo, length - y.shape[1]), (0, 0), (0, 0)]))
    y = mx.concatenate(ys)
    rp.states.set(layer, state=final)
    mx.eval(y, final)
    timing.compute_ms += 1000 * (time.perf_counter() - t0)
    if rp.on_layer is not None:
        rp.on_layer(layer)
    return y, final


def decode_recurrence(stores: list[StateStore], layer: int, original, spec: Recurrence, args: dict,
                      halo: int):
    """Decode: row b's new tokens from conversation b's stored state (`stores[b]`), in one run of the
    recurrence, as mlx-lm runs a batch; stores each conversation's new state."""
    value = args[spec.value]
    args = _per_token(args, *value.shape[:2], lambda a: a[:, halo:])
    args[spec.mask] = None  # the halo is cut off instead
    states = [store.layers[layer].state for store in stores]
    y, state = original(**{**args, spec.state: states[0] if len(states) == 1 else mx.concatenate(states)})
    for b, store in enumerate(stores):
        store.set(layer, state=state[b:b + 1])
    return _pad_front(y, halo), state


def _per_token(args: dict, rows: int, length: int, cut) -> dict:
    """`args` with `cut` applied to each per-token argument ([rows, length, ...])."""
    return {k: cut(v) if isinstance(v, mx.array) and v.ndim >= 2 and v.shape[:2] == (rows, length) else v
            for k, v in args.items()}


def chunk_transform(run, spec: Recurrence, args: dict, first: bool):
    """(y0, r, P, Q) of one chunk, in one run: from the state [0; I] with the inputs [v; 0] (or, for the
    first chunk of the conversation, which needs no P or r, from a zero state)."""
    args = {k: (v.astype(mx.float32) if k in spec.float32 else v) for k, v in args.items()}
    if first:
        y0, q = run(**{**args, spec.state: None})
        return y0, None, None, q
    value = args[spec.value]
    dv, dk = value.shape[-1], args[spec.key].shape[-1]
    stacked = mx.concatenate([value, mx.zeros((*value.shape[:-1], dk), value.dtype)], axis=-1)
    y, s = run(**{**args, spec.value: stacked, spec.state: stacked_start(value.shape[2], dv, dk)})
    return y[..., :dv], y[..., dv:], s[..., dv:, :], s[..., :dv, :]


def _all_gather_transforms(rp: RingPass, layer: int, mine: dict, timing) -> dict:
    """Every chunk's (P, Q), from every rank. A P that was not needed travels as an empty array."""
    ring = rp.ring
    if ring.size == 1:
        return mine
    key = BlockKey(rp.request_id, layer, 0, pb.STATE)
    empty = mx.zeros((0,), mx.float32)
    block = [mx.array(sorted(mine), mx.int32)]
    for c in sorted(mine):
        p, q = mine[c]
        block += [q, empty if p is None else p]
    ring.send_all(key, block, ring.peers)
    timing.bytes_sent += block_nbytes(block) * len(ring.peers)
    found = dict(mine)
    for rank in ring.peers:
        theirs, waited = ring.take(key, rp.abort, rank)
        timing.wait_ms += 1000 * waited
        for i, c in enumerate(np.asarray(theirs[0]).tolist()):
            q, p = theirs[1 + 2 * i], theirs[2 + 2 * i]
            found[c] = (None if p.size == 0 else p, q)
    return found


def _pad_front(y: mx.array, n: int) -> mx.array:
    return mx.pad(y, [(0, 0), (n, 0)] + [(0, 0)] * (y.ndim - 2))
