"""The ring transport on its own: cpchat's rings between two local processes (over gRPC, shared memory
and an mx.distributed group) next to what the wire allows: mx.distributed's ring backend, gRPC Python
moving ready-made bytes (wirefloor.py), a plain TCP socket. Both directions are busy at once, as in a
ring pass."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from cpchat.bench.wirefloor import floor_rates
from cpchat.client.cluster import Cluster
from cpchat.client.launcher import rank_environment
from cpchat.protocol import cpchat_pb2 as pb

MB = 1 << 20
TRANSPORT_ROUNDS = 10  # blocks timed back to back per size, after one untimed warm-up block


def ring_link(cluster: Cluster, probe_bytes: int, rounds: int = 3) -> tuple[float, float]:
    """(bytes/s of the slowest ring link for blocks of probe_bytes, the slowest link's one-way
    latency for a small message in seconds), as the ranks measure them together."""
    request = pb.CalibrateRequest(probe_bytes=probe_bytes, rounds=rounds)
    calls = [
        r.control.Calibrate.future(request, timeout=300, metadata=cluster.metadata) for r in cluster.ranks
    ]
    replies = [c.result() for c in calls]
    return (min(r.ring_bytes_per_s for r in replies),
            max(max(r.link_latency_s, default=0.0) for r in replies))


def median_link(cluster: Cluster, probe_bytes: int, repeats: int) -> tuple[float, float]:
    """`ring_link`'s bandwidth and latency, each the median of `repeats` runs of TRANSPORT_ROUNDS
    blocks: one run is a few milliseconds on a machine whose neighbours come and go."""
    runs = [ring_link(cluster, probe_bytes, TRANSPORT_ROUNDS) for _ in range(max(1, repeats))]
    return statistics.median(r for r, _ in runs), statistics.median(lat for _, lat in runs)


def run_transport(sizes: list[int], repeats: int) -> list[dict]:
    """cpchat's ring over gRPC, shared memory and an mx.distributed group (the median of `repeats`
    runs), next to what those allow (mx.distributed's ring backend, gRPC Python moving ready-made
    bytes, a plain TCP socket); 2 local processes each, both directions busy at once. Each row also
    has the small-message latency."""
    ours: dict[str, dict[int, tuple[float, float]]] = {}
    for transport in ("grpc", "shm", "mlx"):
        cluster = Cluster.launch(2, transport=transport)
        try:
            cluster.connect()
            ours[transport] = {size: median_link(cluster, size, repeats) for size in sizes}
        finally:
            cluster.close()
    mx_rates = mx_distributed_rates(sizes)
    floor = floor_rates(sizes, TRANSPORT_ROUNDS, env=rank_environment())
    results = []
    for size in sizes:
        row = {"block_mib": size // MB}
        for transport, rates in ours.items():
            rate, latency = rates[size]
            row |= {f"{transport}_ring_gb_s": rate / 1e9, f"{transport}_latency_us": latency * 1e6}
        row |= {
            "mx_distributed_gb_s": mx_rates.get(size, 0.0) / 1e9,
            "grpc_bytes_only_gb_s": floor.get("grpc", {}).get(size, 0.0) / 1e9,
            "tcp_socket_gb_s": floor.get("socket", {}).get(size, 0.0) / 1e9,
        }
        results.append(row)
        print(
            f"  ring {size // MB:>3} MiB: cpchat gRPC {row['grpc_ring_gb_s']:.2f} GB/s "
            f"({row['grpc_latency_us']:.0f} µs), shared memory {row['shm_ring_gb_s']:.2f} "
            f"({row['shm_latency_us']:.0f} µs), mx.distributed {row['mlx_ring_gb_s']:.2f} "
            f"({row['mlx_latency_us']:.0f} µs); bytes only: mx.distributed {row['mx_distributed_gb_s']:.2f}, "
            f"gRPC bytes only {row['grpc_bytes_only_gb_s']:.2f}, TCP socket {row['tcp_socket_gb_s']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return results


def mx_distributed_rates(sizes: list[int]) -> dict[int, float]:
    """Bytes/s of mx.distributed's own ring backend (mxdist.py under mlx.launch), {} where it cannot run."""
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    script = str(Path(__file__).with_name("mxdist.py"))
    cmd = [
        launcher,
        "-n",
        "2",
        "--backend",
        "ring",
        "--",
        sys.executable,
        script,
        ",".join(str(s) for s in sizes),
        str(TRANSPORT_ROUNDS),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=rank_environment())
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("{"))
        return {int(k): v for k, v in json.loads(line).items()}
    except (OSError, StopIteration, subprocess.TimeoutExpired, ValueError):
        print("  mx.distributed comparison unavailable", file=sys.stderr)
        return {}


def transport_table(transport: list[dict], repeats: int) -> list[str]:
    """The Markdown lines of `run_transport`'s rows, after a note on how they were measured."""
    lines = [
        f"Ring transport, GB/s per link: 2 local processes, both directions at once, "
        f"{TRANSPORT_ROUNDS} blocks back to back after a warm-up block, the median of "
        f"{repeats} such runs for cpchat's rings. Latency: one way, a small message (half the "
        f"best of 5 round trips), measured beside each row's blocks (the median of the runs).",
        "",
        "| block | cpchat gRPC ring | cpchat shared memory | cpchat mx.distributed (ring backend) "
        "| mx.distributed ring, bytes only | gRPC Python, bytes only | TCP socket "
        "| gRPC latency µs | shared-memory latency µs | mx.distributed latency µs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return lines + [
        f"| {t['block_mib']} MiB | {t['grpc_ring_gb_s']:.2f} | {t['shm_ring_gb_s']:.2f} "
        f"| {t['mlx_ring_gb_s']:.2f} | {t['mx_distributed_gb_s']:.2f} | {t['grpc_bytes_only_gb_s']:.2f} "
        f"| {t['tcp_socket_gb_s']:.2f} | {t['grpc_latency_us']:.0f} | {t['shm_latency_us']:.0f} "
        f"| {t['mlx_latency_us']:.0f} |"
        for t in transport
    ]
