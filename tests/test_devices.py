"""One local rank per GPU (--devices): which devices are visible, and the rank processes pinned to
them in turn through CUDA_VISIBLE_DEVICES. No GPU here: the driver's listing is a folder the test
makes, and the ranks, pinned to devices they cannot see, compute on the CPU as before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from rankprocs import CPCHAT

from cpchat.client.cluster import Cluster
from cpchat.client.launcher import rank_devices, visible_gpus
from cpchat.errors import BadInput


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_visible_gpus_follow_the_environment_then_the_driver(tmp_path):
    driver = tmp_path / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (driver / bus).mkdir(parents=True)
    assert visible_gpus({}, driver) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}, driver) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, driver) == []
    assert visible_gpus({}, tmp_path / "no-driver") == []


def test_device_choices():
    assert rank_devices("all", ["0", "1"]) == ["0", "1"]
    assert rank_devices("none", ["0", "1"]) == []
    assert rank_devices("1", ["0", "1"]) == ["1"]
    assert rank_devices("all", []) == []
    with pytest.raises(ValueError, match="--devices 2,0: 2 not found; the visible GPUs are 0, 1"):
        rank_devices("2,0", ["0", "1"])
    with pytest.raises(ValueError, match="no NVIDIA GPU is visible"):
        rank_devices("0", [])


def test_local_ranks_are_pinned_one_per_gpu_in_turn(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    cluster = Cluster.launch(3)
    try:
        cluster.connect()
        pinned = [environ_of(r.local.process.pid)["CUDA_VISIBLE_DEVICES"] for r in cluster.ranks]
        assert pinned == ["3", "5", "3"]
    finally:
        cluster.close()
    cluster = Cluster.launch(2, devices="none")
    try:
        assert [environ_of(r.local.process.pid)["CUDA_VISIBLE_DEVICES"] for r in cluster.ranks] == ["3,5"] * 2
    finally:
        cluster.close()
    with pytest.raises(BadInput, match="--devices 4: 4 not found; the visible GPUs are 3, 5"):
        Cluster.launch(2, devices="4")


def test_an_unknown_device_is_one_line_and_exit_2(model_dir):
    done = subprocess.run(CPCHAT + ["--headless", "--devices", "0,1", "--model", str(model_dir("llama")),
                                    "--prompt", "hi"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last == "cpchat: --devices 0,1: 1 not found; the visible GPUs are 0"
    assert "Traceback" not in done.stderr
