"""Tensors through an mx.distributed group (`--transport mlx`, the ring backend over TCP here):
exact as every other path, with the ring neighbours on the group and the other pairs on shared
memory; a rank killed mid-answer is named, and its survivors answer again over the other links."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import ALGORITHMS, assert_same, next_turn, random_prompt, raw_session, run_raw
from rankprocs import CPCHAT, start_ranks, stop_all, write_token
from references import reference_generate

from cpchat.client.cluster import Cluster
from cpchat.client.generation import GenerationRequest, LayerDone
from cpchat.errors import BackendError, BadInput

DETECT_S = 5.0


def expected_links(n: int) -> list[list[str]]:
    """The ring backend reaches a rank's two neighbours; shared memory carries the rest."""
    return [["" if i == j else "mlx" if (i - j) % n in (1, n - 1) else "shm" for j in range(n)]
            for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "arch"), [(2, "qwen3"), (3, "llama"), (4, "mistral")])
def test_every_algorithm_through_mx_distributed(clusters, model_dir, ranks, arch):
    path = model_dir(arch)
    cluster = clusters.get(ranks, path, transport="mlx")
    assert cluster.link_transports == expected_links(ranks)
    assert cluster.transport_label == ("mlx+shm" if ranks == 4 else "mlx")
    for length in (1, 6 * ranks + 1, 2001):
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, 8)
        for algorithm in ALGORITHMS:
            cluster.reset(0)
            before = [s.data_plane_bytes_sent for s in cluster.stats_once()]
            assert_same(run_raw(cluster, path, ids, algorithm, 8)[0], expected)
            sent = [s.data_plane_bytes_sent - b for s, b in zip(cluster.stats_once(), before, strict=True)]
            # A decode step's small blocks ride in their gRPC frames; a long prompt's KV takes the group.
            assert all(sent) if length == 2001 else not any(sent)


@pytest.mark.slow
def test_turns_through_mx_distributed_and_a_re_formed_ring(clusters, model_dir):
    """Follow-up turns on one cache; then the same ranks form a new ring on the group they formed."""
    path = model_dir("qwen2")
    cluster = clusters.get(3, path, transport="mlx")
    session = raw_session(cluster, path, "pass_kv", 6)
    history: list[int] = []
    for turn, (algorithm, length) in enumerate(zip(ALGORITHMS, (300, 41, 90, 1, 17), strict=True)):
        session.planner.algorithm = algorithm
        new = random_prompt(path, length, seed=300 + turn)
        tokens, _ = next_turn(session, new)
        history += new
        assert_same(tokens, reference_generate(path, history, 6))
        history += [t for t, _ in tokens]
    cluster.connect()  # a new ring id: every link replaced, the group kept
    cluster.load(str(path))
    ids = random_prompt(path, 500, seed=5)
    assert_same(run_raw(cluster, path, ids, "ulysses", 6)[0], reference_generate(path, ids, 6))


@pytest.mark.slow
def test_bfloat16_travels_bit_for_bit(clusters, checkpoint):
    """The same bfloat16 checkpoint gives the very same logprobs over the group as over shared
    memory (whose exactness against mlx-lm test_low_precision checks)."""
    path = checkpoint("bfloat16")
    ids = random_prompt(path, 700, seed=9)
    over = {}
    for transport in ("mlx", "auto"):
        cluster = clusters.get(2, path, transport=transport)
        over[transport] = run_raw(cluster, path, ids, "pass_kv", 12)[0]
    assert over["mlx"] == over["auto"]


def handles(*backends: tuple[str, ...]) -> Cluster:
    """A cluster (never connected) whose ranks reported these backends in Health."""
    cluster = Cluster([f"127.0.0.1:{9000 + i}" for i in range(len(backends))], transport="auto")
    for rank, available in zip(cluster.ranks, backends, strict=True):
        rank.data_plane_backends = available
    return cluster


def test_which_backend_the_ranks_share():
    cluster = handles(("ring",), ("ring",))
    assert cluster.data_plane_backend() == ""  # auto: the TCP ring is slower than shm, no faster than gRPC
    cluster.transport = "grpc"
    assert cluster.data_plane_backend() == ""
    cluster.transport = "mlx"
    assert cluster.data_plane_backend() == "ring"
    cluster = handles(("ring",), ())
    cluster.transport = "mlx"
    with pytest.raises(BadInput, match=r"common to every rank \(rank 0 .*: ring; rank 1 .*: none\)"):
        cluster.data_plane_backend()
    cluster = handles(("ring",))
    cluster.transport = "mlx"
    assert cluster.data_plane_backend() == ""  # one rank has no pairs


@pytest.mark.slow
def test_headless_names_the_data_plane(model_dir):
    path = model_dir("llama")
    command = ["--headless", "--ranks", "2", "--transport", "mlx", "--model", str(path), "--raw", "--temp",
               "0", "--json", "--max-tokens", "4", "--prompt", "a b c"]
    done = subprocess.run(CPCHAT + command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["transport"] == "mlx"


@pytest.mark.slow
@pytest.mark.alone
def test_a_rank_killed_mid_prefill_is_named_and_the_survivors_answer(model_dir, tmp_path):
    path = model_dir("llama")
    token = write_token(tmp_path / "token", "data-plane-token")
    ranks = start_ranks(3, tmp_path, token_file=token)
    addresses = [r.address for r in ranks]
    try:
        cluster = Cluster(addresses, token="data-plane-token", transport="mlx")
        try:
            cluster.connect()
            cluster.load(str(path))
            assert cluster.transport_label == "mlx"
            ids = random_prompt(path, 3000, seed=1)
            fault = None
            with pytest.raises(BackendError) as err:
                request = GenerationRequest(ids, max_tokens=4, algorithm="pass_kv")
                for event in cluster.generate(request):
                    if isinstance(event, LayerDone) and fault is None:
                        os.kill(ranks[2].pid, signal.SIGKILL)
                        fault = time.monotonic()
            assert time.monotonic() - fault < DETECT_S
            assert f"rank 2 ({addresses[2]}) stopped answering during prefill" in str(err.value)
        finally:
            cluster.close()
        survivors = addresses[:2]
        again = Cluster(survivors, token="data-plane-token", transport="mlx")
        try:  # their group held the dead rank; mx.distributed cannot form another in the same process
            with pytest.raises(BackendError, match="restart the rank"):
                again.connect()
        finally:
            again.close()
        again = Cluster(survivors, token="data-plane-token")
        try:
            again.connect(timeout=30)  # the survivors may still be winding the request down
            again.load(str(path))
            assert again.transport_label == "shm"
            ids = random_prompt(path, 40, seed=2)
            assert [t for t, _ in run_raw(again, path, ids, "pass_kv", 5)[0]] == \
                [t for t, _ in reference_generate(path, ids, 5)]
        finally:
            again.close()
    finally:
        stop_all(ranks)
