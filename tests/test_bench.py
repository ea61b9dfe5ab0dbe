"""`cpchat bench` end to end on a tiny configuration: it writes its table, JSON and chart."""

import json
import subprocess
import sys

from cpchat.client.launcher import rank_environment


def test_bench_writes_results(tmp_path, model_dir):
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpchat",
            "bench",
            "--model",
            str(model_dir("llama")),
            "--contexts",
            "64,128",
            "--ranks",
            "1,2",
            "--repeats",
            "1",
            "--decode",
            "4",
            "--transport",
            "1,9",  # 9 MiB: a block of three frames between real ranks
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    systems = {(r["system"], r["context"]) for r in data["rows"]}
    assert systems == {(s, c) for s in ("mlx-lm", "cpchat N=1", "cpchat N=2") for c in (64, 128)}
    for row in data["rows"]:
        assert row["prefill_tokens_per_s"][0] > 0 and row["decode_tokens_per_s"][0] > 0
        # peak resident memory of a process holding an MLX runtime and a model: tens of MiB at least
        assert 20 << 20 < row["peak_bytes_per_rank"] < 8 << 30
        if row["system"] == "cpchat N=2":
            assert 0.0 <= row["hidden_share"] <= 1.0 and row["kv_bytes_per_rank"] > 0
    assert [t["block_mib"] for t in data["transport"]] == [1, 9]
    for t in data["transport"]:
        assert t["grpc_ring_gb_s"] > 0 and t["grpc_bytes_only_gb_s"] > 0 and t["tcp_socket_gb_s"] > 0
    table = (out / "results.md").read_text()
    # every row names the BLAS its processes really used, as a separate process detects it
    detect = "from cpchat.blas import in_use; print(in_use().label)"
    used = subprocess.run([sys.executable, "-c", detect], env=rank_environment(), capture_output=True,
                          text=True, timeout=120).stdout.strip()
    assert used and {row["blas"] for row in data["rows"]} == {used}
    assert f"| cpchat N=2 | {used} | 128 |" in table
