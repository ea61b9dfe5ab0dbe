"""What the front end's cost model needs to know of a ring (cpchat.core.heuristics), measured on
every rank together: matrix-product speed, the ring's bandwidth, the links' latency, and the loaded
model's prefill cost (measured once, when it loaded).

The probes are blocks of kind PROBE through the ring's own links, so they time what a ring pass
meets: the same transport, the same mailbox. Every rank of the ring runs the same probes, under the
same ids, on its MLX thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from cpchat.core.estimate import PrefillCost
from cpchat.protocol import cpchat_pb2 as pb
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
