"""Which BLAS MLX really multiplies with: detected in real processes, with and without a library
preloaded; ranks re-execute themselves onto the fastest one; the bench refuses a BLAS it cannot load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rankprocs import start_ranks

from cpchat import blas
from cpchat.bench import main as bench_main
from cpchat.cli import main as cli_main
from cpchat.client.cluster import Cluster
from cpchat.errors import BadInput

NAMES = {"openblas": "OpenBLAS", "mkl": "oneMKL"}
DETECT = ("import json, dataclasses; from cpchat.blas import in_use; "
          "print(json.dumps(dataclasses.asdict(in_use())))")


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def detected(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", DETECT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def installed(kind: str) -> Path:
    path = blas.find(kind)
    if path is None:
        pytest.skip(f"no {kind} on this machine (.ci/run installs both)")
    return path


def test_without_a_preload_mlx_multiplies_with_the_wheels_reference_blas():
    found = detected(clean_environment())
    assert found["name"] == "reference"
    assert "mlx_cpu.libs" in found["library"]


@pytest.mark.parametrize("kind", ["openblas", "mkl"])
def test_a_preloaded_library_is_the_one_detected(kind):
    path = installed(kind)
    found = detected(blas.preload_environment(kind, clean_environment()))
    assert found["name"] == NAMES[kind]
    assert found["version"]  # read from the library itself
    assert os.path.realpath(found["library"]) == os.path.realpath(path)


def test_preload_environment_swaps_one_blas_for_another_and_keeps_other_preloads():
    openblas, mkl = installed("openblas"), installed("mkl")
    env = {"LD_PRELOAD": f"/opt/libjemalloc.so {openblas}"}
    assert blas.preload_environment("mkl", env)["LD_PRELOAD"] == f"{mkl} /opt/libjemalloc.so"
    assert blas.preload_environment("reference", env)["LD_PRELOAD"] == "/opt/libjemalloc.so"
    assert "LD_PRELOAD" not in blas.preload_environment("reference", {"LD_PRELOAD": str(openblas)})
    assert blas.preload_environment("auto", {})["LD_PRELOAD"] == str(openblas)  # the fastest measured


@pytest.fixture
def no_openblas(monkeypatch, tmp_path):
    """A machine without OpenBLAS: the finder looks only where nothing is."""
    monkeypatch.setattr(blas, "openblas_paths", lambda: [tmp_path / "libopenblas.so.0"])


def test_a_missing_library_is_refused_with_the_command_that_installs_one(no_openblas):
    message = r"--blas openblas: no openblas library found; install one with: .*mkl"
    with pytest.raises(blas.BlasUnavailable, match=message):
        blas.choose("openblas")


def test_bench_refuses_a_blas_it_cannot_load(no_openblas, monkeypatch, capsys, tmp_path):
    assert bench_main(["--quick", "--blas", "openblas", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpchat bench: --blas openblas: no openblas library found")
    monkeypatch.setattr(blas, "mkl_paths", lambda: [])
    assert bench_main(["--quick", "--blas", "both", "--out", str(tmp_path)]) == 2
    assert "no fast BLAS found to compare" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_rank_refuses_a_blas_it_cannot_load(no_openblas, capsys):
    assert cli_main(["rank", "--port", "0", "--blas", "openblas"]) == 2
    assert "cpchat rank: --blas openblas: no openblas library found" in capsys.readouterr().err


@pytest.mark.slow
def test_ranks_reexecute_onto_their_blas_and_report_it(tmp_path, model_dir):
    """Started by hand without LD_PRELOAD, a rank finds the fastest BLAS itself; `--blas reference`
    drops an inherited preload. Health reports each, and the headless front end shows both and
    warns once about the slow one, with the fix."""
    openblas = installed("openblas")
    inherited = clean_environment() | {"LD_PRELOAD": str(openblas)}  # rank 1 must drop it
    ranks = start_ranks(1, tmp_path, env=clean_environment())
    ranks += start_ranks(1, tmp_path, args=[["--blas", "reference"]], env=inherited)
    try:
        fast, slow = ranks
        cluster = Cluster([fast.address, slow.address])
        cluster.connect()
        try:
            assert cluster.ranks[0].blas.name == "OpenBLAS" and not cluster.ranks[0].blas.fix
            assert cluster.ranks[1].blas.name == "reference"
            assert "libopenblas0-pthread" in cluster.ranks[1].blas.fix
            warning = cluster.slow_blas_warning()
            assert warning.startswith(f"rank 1 ({slow.address}) multiplies with the reference BLAS")
        finally:
            cluster.close()
        done = subprocess.run(
            [sys.executable, "-m", "cpchat", "--headless", "--json", "--model", str(model_dir("llama")),
             "--attach", f"{fast.address},{slow.address}", "--prompt", "hi", "--max-tokens", "2"],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        ready = json.loads(done.stdout.splitlines()[0])
        assert [r["blas"].split()[0] for r in ready["ranks"]] == ["OpenBLAS", "reference"]
        warned = [line for line in done.stderr.splitlines() if "reference BLAS" in line]
        assert warned == [f"cpchat: {warning}"]
    finally:
        for r in ranks:
            r.stop()


@pytest.mark.slow
def test_the_app_launches_its_ranks_on_the_blas_asked_for(model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "cpchat", "--headless", "--json", "--ranks", "2", "--blas", "reference",
         "--model", str(model_dir("llama")), "--prompt", "hi", "--max-tokens", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ready = json.loads(done.stdout.splitlines()[0])
    assert [r["blas"] for r in ready["ranks"]] == ["reference", "reference"]
    warned = [line for line in done.stderr.splitlines() if "reference BLAS" in line]
    assert len(warned) == 1 and warned[0].startswith("cpchat: the ranks multiply with the reference BLAS")


def test_launching_on_a_blas_that_is_not_installed_is_bad_input(no_openblas):
    with pytest.raises(BadInput, match="--blas openblas: no openblas library found"):
        Cluster.launch(1, "openblas")


def test_cores_are_shared_out_at_least_one_thread_each():
    assert blas.shared_threads(1, cores=16) == 16
    assert blas.shared_threads(2, cores=16) == 8 and blas.shared_threads(3, cores=16) == 5
    assert blas.shared_threads(4, cores=2) == 1
    env = blas.thread_environment(3, {"OPENBLAS_NUM_THREADS": "1", "PATH": "/bin"})
    threads = {name: "3" for name in blas.THREAD_VARIABLES}
    assert env == {"PATH": "/bin", **threads, "OPENBLAS_THREAD_TIMEOUT": "4"}  # idle threads sleep soon


@pytest.mark.slow
def test_local_ranks_run_the_threads_they_are_given_and_report_them(tmp_path, model_dir):
    """One launched rank takes every core; `--threads` wins over the share; a rank started in an
    environment with other thread settings re-executes itself with its own. Health reports what
    OpenBLAS says (it runs no more threads than there are cores)."""
    installed("openblas")
    done = subprocess.run(
        [sys.executable, "-m", "cpchat", "--headless", "--json", "--ranks", "1", "--model",
         str(model_dir("llama")), "--prompt", "hi", "--max-tokens", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [r["threads"] for r in json.loads(done.stdout.splitlines()[0])["ranks"]] == [blas.usable_cores()]
    assert blas.usable_cores() >= 2, "this test needs two cores"
    cluster = Cluster.launch(2, threads=2)  # the share would be one thread each on two cores
    (by_hand,) = start_ranks(1, tmp_path, args=[["--threads", "1"]])  # its environment says every core
    try:
        cluster.connect()
        assert [r.blas.threads for r in cluster.ranks] == [2, 2]
        attached = Cluster([by_hand.address])
        attached.connect()
        assert attached.ranks[0].blas.name == "OpenBLAS" and attached.ranks[0].blas.threads == 1
        attached.close()
    finally:
        cluster.close()
        by_hand.stop()


def test_a_thread_count_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--headless", "--threads", "0", "--prompt", "hi"])
    assert exit_.value.code == 2
    assert "--threads: expected a whole number of at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["openblas", "mkl"])
def test_a_rank_can_run_its_blas_on_more_threads_for_a_while(kind):
    """A lead decode step runs rank 0's products on every core, and its prefill on its share again."""
    installed(kind)
    env = blas.thread_environment(1, blas.preload_environment(kind, clean_environment()))
    script = ("import json; from cpchat.blas import in_use, threads\n"
              "before = in_use().threads\n"
              "with threads(2):\n    during = in_use().threads\n"
              "print(json.dumps([before, during, in_use().threads]))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [1, 2, 1]  # (oneMKL runs at most one thread a core: 2 here)
