"""A forward of the model over this rank's rows: the model's own __call__, with the ring's caches."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from cpchat.rank import fit, stages
from cpchat.rank.algorithms import ATTEND
from cpchat.rank.context_parallel import RingPass, ShardCache
from cpchat.rank.fit import UnsupportedModel
from cpchat.rank.kvstore import KVShard
from cpchat.rank.linear_layers import StateCache
from cpchat.rank.stages import Handoff
from cpchat.rank.statestore import StateStore
from cpchat.rank.transport.ring import Mailbox, Ring


def run_model(model, ring_pass: RingPass, ids: mx.array, row: int | slice, evaluate: bool = True,
              handoff: Handoff | None = None) -> mx.array | None:
    """The model's own __call__ (so its output path — softcapping, logit scaling — runs as in
    mlx-lm) over this rank's rows, with the head applied to one flattened row only (logits [vocab]),
    or to a slice of them (a speculative block: [n, vocab]); evaluated, or
    left a graph for the caller to evaluate. A pipeline stage but the last hands its hidden states
    on (`handoff`) and returns None."""
    caches = [StateCache(ring_pass, i) if i in ring_pass.linear else ShardCache(ring_pass, i)
              for i in range(ring_pass.kv.num_layers)]
    logits = None
    with fit.head_on_row(model, row), stages.handing(handoff):
        try:
            logits = model(ids, cache=caches)
        except stages.StageEnd:
            pass
    if evaluate and logits is not None:
        mx.eval(logits)
    if ring_pass.store:
        ring_pass.kv.commit(evaluate)
    if logits is None:
        return None
    return logits[0] if isinstance(row, slice) else logits[0, 0]


def probe_forward(model, vocab_size: int, chunk: int = 3) -> fit.ProbeResult:
    """One forward through a ring of one rank, laid out as a prefill is (two rows of `chunk`
    tokens at different positions), recording what every layer's attention was given. The token
    ids stay inside the vocabulary: MLX's gather does not check, and read past the embedding."""
    slots = fit.cache_slots(model)
    elsewhere = stages.elsewhere(model)
    linear = frozenset(i for i, s in enumerate(slots) if s.state) - elsewhere
    kv = KVShard(len(slots), linear, elsewhere=elsewhere)
    ring = Ring(0, 1, {}, Mailbox(lambda frame, size: None))
    positions = np.arange(2 * chunk)
    ring_pass = RingPass(
        request_id="probe", algorithm="pass_kv", ring=ring, kv=kv, row_offsets=mx.array([0, chunk]),
        q_positions=positions, real=np.ones(2 * chunk, bool), store=True,
        abort=threading.Event(), windows=[s.window for s in slots], linear=linear, states=StateStore(),
        seq_len=2 * chunk, crossing=ATTEND["pass_kv"],
    )
    kv.begin_append(positions)
    try:
        ids = mx.arange(2 * chunk) % vocab_size
        run_model(model, ring_pass, ids.reshape(2, chunk), row=2 * chunk - 1)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{fit.model_name(model)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any failure means the hook does not fit this model
        raise UnsupportedModel(
            f"{fit.model_name(model)}: the model does not run with cpchat's context-parallel "
            f"layout (rows of tokens at different positions, attention through the ring): "
            f"{type(e).__name__}: {e}") from None
    return fit.ProbeResult(slots, ring_pass.calls, kv, ring_pass.recurrences, ring_pass.states)
