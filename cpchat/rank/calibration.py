"""What the front end's cost model needs to know of a ring (cpchat.core.heuristics), measured on
every rank together: matrix-product speed, the ring's bandwidth, the links' latency, and the loaded
model's prefill cost (measured once, when it loaded).

The probes are blocks of kind PROBE through the ring's own links, so they time what a ring pass
meets: the same transport, the same mailbox. Every rank of the ring runs the same probes, under the
same ids, on its MLX thread."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cpchat import blas
from cpchat.core.attention import partial_attention
from cpchat.core.estimate import PrefillCost, line_through, rank_pairs
from cpchat.core.memory import ForwardMemory
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.rank.cpu_products import MIN_ROWS
from cpchat.rank.forward import probe_forward
from cpchat.rank.model_load import ModelShape
from cpchat.rank.transport.ring import Ring
from cpchat.rank.transport.wire import BlockKey

PROBE_BYTES = 4 << 20
MAX_PROBE_BYTES = 256 << 20
CALIBRATE_TIMEOUT_S = 30.0
LATENCY_ROUNDS = 5
MAX_PAIRWISE_PROBES = 16  # ranks; larger rings time their neighbours' links only
PROBE_BANDWIDTH, PROBE_PING, PROBE_ECHO, PROBE_EXCHANGE = range(4)  # the `layer` of calibration probes


@dataclass
class Calibration:
    """What Calibrate measures on one rank (see CalibrateReply)."""

    flops_per_s: float
    ring_bytes_per_s: float
    prefill: PrefillCost
    link_latency_s: list[float]
    exchange_latency_s: float


def calibrate(ring: Ring, request_id: str, prefill: PrefillCost, probe_bytes: int = PROBE_BYTES,
              rounds: int = 3) -> Calibration:
    """Every measure, its probes keyed by `request_id` (the same on every rank). A neighbour that
    hangs aborts the probes after CALIBRATE_TIMEOUT_S, which frees the MLX thread."""
    calibration = Calibration(matmul_flops(), float("inf"), prefill, [0.0] * ring.size, 0.0)
    if ring.size == 1:
        return calibration
    abort = threading.Event()
    deadline = threading.Timer(CALIBRATE_TIMEOUT_S, abort.set)
    deadline.start()
    try:
        calibration.ring_bytes_per_s = ring_bandwidth(ring, request_id, probe_bytes, rounds, abort)
        calibration.link_latency_s = link_latency(ring, request_id, abort)
        calibration.exchange_latency_s = exchange_latency(ring, request_id, abort)
    finally:
        deadline.cancel()
        ring.mailbox.forget(request_id)
    return calibration


def matmul_flops(n: int = 512) -> float:
    """Floating-point operations per second of an n x n matrix product, after a warm-up."""
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    t0 = time.perf_counter()
    for _ in range(8):
        mx.eval(a @ a)
    return 8 * 2 * n**3 / (time.perf_counter() - t0)


def ring_bandwidth(ring: Ring, request_id: str, probe_bytes: int, rounds: int, abort: threading.Event
                   ) -> float:
    """Bytes per second of a large block sent to the next rank while every rank does the same.
    The whole run is timed, not its best round: a neighbour that runs a round ahead makes a
    single round look faster than the link is."""
    block = [mx.zeros((probe_bytes // 4,), mx.float32)]
    for round_ in range(rounds + 1):  # the first one warms the link up, untimed
        if round_ == 1:
            t0 = time.perf_counter()
        key = BlockKey(request_id, PROBE_BANDWIDTH, round_, pb.PROBE)
        ring.send(key, block)
        ring.take(key, abort)
    return block[0].nbytes * rounds / (time.perf_counter() - t0)


def link_latency(ring: Ring, request_id: str, abort: threading.Event) -> list[float]:
    """One way, to each rank: half the best round trip of a small ping this rank sends and the
    peer echoes. Pairs take turns in one order on every rank (ring neighbours only in rings
    larger than MAX_PAIRWISE_PROBES)."""
    size, me, tiny = ring.size, ring.rank, [mx.zeros((1,), mx.float32)]
    pairs = [(a, b) for a in range(size) for b in range(size) if a != b]
    if size > MAX_PAIRWISE_PROBES:
        pairs = [(a, (a + 1) % size) for a in range(size)]
    latency = [0.0] * size
    for sender, peer in pairs:
        if me not in (sender, peer):
            continue
        best = float("inf")
        for round_ in range(LATENCY_ROUNDS):
            ping = BlockKey(request_id, PROBE_PING, round_, pb.PROBE)
            echo = BlockKey(request_id, PROBE_ECHO, round_, pb.PROBE)
            if me == sender:
                t0 = time.perf_counter()
                ring.send(ping, tiny, to=peer)
                ring.take(echo, abort, source=peer)
                best = min(best, time.perf_counter() - t0)
            else:
                ring.take(ping, abort, source=sender)
                ring.send(echo, tiny, to=sender)
        if me == sender:
            latency[peer] = best / 2
    return latency


def exchange_latency(ring: Ring, request_id: str, abort: threading.Event) -> float:
    """Seconds for a small message to every other rank and one from each, at once (the pattern
    of the one-step decode exchange), averaged over rounds after a warm-up."""
    tiny = [mx.zeros((1,), mx.float32)]
    for round_ in range(LATENCY_ROUNDS + 1):
        if round_ == 1:
            t0 = time.perf_counter()
        key = BlockKey(request_id, PROBE_EXCHANGE, round_, pb.PROBE)
        ring.send_all(key, tiny, ring.peers)
        for peer in ring.peers:
            ring.take(key, abort, source=peer)
    return (time.perf_counter() - t0) / LATENCY_ROUNDS


@functools.cache
def attention_pair_s(query_heads: int, key_heads: int, key_dim: int, value_dim: int, cpu_allowance: float,
                     threads: int) -> tuple[float, float]:
    """Seconds a query-key pair of one layer's attention takes in a prefill's tiles, every pair visible
    and under a causal mask: measured once per shape in a rank's life (for the CPU time and the BLAS
    threads it has then), whatever model it loads."""
    queries, keys = 1024, 2048
    q = mx.random.normal((1, query_heads, queries, key_dim))
    k = mx.random.normal((1, key_heads, keys, key_dim))
    v = mx.random.normal((1, key_heads, keys, value_dim))
    mx.eval(q, k, v)

    def per_pair_s(first_query: int, key_count: int, warm_up: int = 0) -> float:
        """Seconds a pair, the queries from `first_query` on over the first `key_count` keys (after
        `warm_up` runs untimed)."""
        q_pos, k_pos = np.arange(first_query, first_query + queries), np.arange(key_count)

        def once() -> float:
            start = time.perf_counter()
            mx.eval(*partial_attention(q, k[:, :, :key_count], v[:, :, :key_count], q_pos, k_pos, scale=1.0))
            return time.perf_counter() - start

        runs = [once() for _ in range(warm_up + 5)][warm_up:]
        return statistics.median(runs) / (queries * key_count)

    # A freshly loaded rank's first few tiles ran up to twice as slowly as the rest (measured).
    visible = per_pair_s(keys, keys, warm_up=4)  # every pair visible
    return visible, max(per_pair_s(0, queries), visible)  # one tile on the diagonal: a causal mask


def measure_prefill(model, info: ModelShape) -> tuple[PrefillCost, ForwardMemory]:
    """Time this model here: each query-key pair's attention cost (`attention_pair_s`); then a forward
    of a few tokens and one long enough to take about 0.6 s more (up to 1024 tokens), less their own
    attention at those costs, for the weights' work.
    Each is the median of a few runs, not the fastest: a prefill sums many such calls, the odd slow
    one included. The short forward has MIN_ROWS tokens a row, so both run the products a prefill
    runs (below that, a low-precision model's run MLX's native kernels, many times slower a token).
    The same two forwards' peak memory, less the K/V they stored, gives what a forward of T tokens
    allocates for its activations; a forward of one token a row, a decode step's cost."""
    layer = info.first_attention
    layers = info.attention_layers  # of its stage
    visible, masked = (layers * c for c in attention_pair_s(layer.query_heads, layer.key_heads, layer.key_dim,
                                                            layer.value_dim, blas.cpu_allowance(),
                                                            blas.in_use().threads))
    attention = PrefillCost(0, 0, visible, 0, masked)
    groups = max(layer.query_heads // layer.key_heads, 1)
    peaks: dict[int, int] = {}

    def forward_s(tokens: int) -> float:
        """A prefill forward of `tokens` on one rank."""
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        kv = probe_forward(model, info.vocab_size, tokens // 2).kv
        seconds = time.perf_counter() - start
        peaks[tokens] = mx.get_peak_memory() - held - kv.nbytes  # the activations: K/V are counted apart
        return seconds

    def typical_s(tokens: int) -> float:
        return statistics.median(forward_s(tokens) for _ in range(3))

    def own_attention_s(tokens: int) -> float:
        return attention.rank_seconds(0, rank_pairs(tokens, 0, 1, groups)[0])

    few = 2 * MIN_ROWS
    short = typical_s(few)
    tokens = int(min(max(few * 0.6 / max(short, 1e-6), 4 * few), 1024)) // 2 * 2
    long = typical_s(tokens)
    fixed, per_token = line_through(few, short - own_attention_s(few), tokens, long - own_attention_s(tokens))
    if per_token == 0:  # a tiny model's products, lost in its attention's noise: count them with it
        fixed, per_token = line_through(few, short, tokens, long)
    memory = ForwardMemory(*line_through(few, peaks[few], tokens, peaks[tokens]))
    step = typical_s(2)  # rows of one token: a decode step's kernels
    return PrefillCost(fixed, per_token, visible, step, masked), memory
