"""Start local `cpchat rank` processes on free loopback ports.

Ranks watch our pid and exit when we die (also on SIGKILL), so they never
outlive the front end. Ranks get the fastest BLAS installed, preloaded
(cpchat/blas.py): the mlx[cpu] wheel's reference BLAS is 20-30x slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cpchat import blas

START_TIMEOUT_S = 60.0
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the NVIDIA driver runs


class LaunchError(RuntimeError):
    pass


@dataclass
class LocalRank:
    index: int
    process: subprocess.Popen
    address: str
    log_path: Path

    def stop(self, timeout: float = 3.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.log_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.log_path.parent.rmdir()  # the last rank of the launch removes the folder


def rank_environment(blas_choice: str = "auto", threads: int = 1) -> dict[str, str]:
    """The environment of a local rank (and of benchmark children): the BLAS preloaded, running
    `threads` threads."""
    env = blas.thread_environment(threads, blas.preload_environment(blas_choice))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def visible_gpus(environ: dict[str, str] | None = None, driver: Path = NVIDIA_GPUS) -> list[str]:
    """The CUDA devices this process may hand to ranks: CUDA_VISIBLE_DEVICES where it is set, else
    every GPU the NVIDIA driver runs (none on a Mac: its one GPU is shared, not pinned)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(list(driver.iterdir())))]
    except OSError:
        return []


def rank_devices(choice: str, visible: list[str]) -> list[str]:
    """The devices local ranks are pinned to, one rank per device in turn (--devices): "all"
    visible ones, "none", or a comma list of them. Raises ValueError for one that is not visible."""
    if choice == "none":
        return []
    if choice == "all":
        return visible
    wanted = [d.strip() for d in choice.split(",") if d.strip()]
    if not wanted:
        raise ValueError("--devices: expected all, none, or a comma list of GPU indices")
    unknown = [d for d in wanted if d not in visible]
    if unknown:
        seen = f"the visible GPUs are {', '.join(visible)}" if visible else "no NVIDIA GPU is visible"
        raise ValueError(f"--devices {choice}: {', '.join(unknown)} not found; {seen}")
    return wanted


def launch_local_ranks(n: int, blas_choice: str = "auto", pin_cpus: bool = False,
                       devices: list[str] | None = None, flags: Sequence[str] = (),
                       threads: int | None = None) -> list[LocalRank]:
    """Start n ranks at once and wait until each reports its address. With pin_cpus, rank i runs
    on core i (modulo the cores there are); with devices, on devices[i] (modulo their number);
    `flags` go to each (`cpchat rank --cache-dir ...`). Each runs `threads` BLAS threads, by default
    an equal share of the cores (one where pinned)."""
    if n < 1:
        raise LaunchError(f"--ranks must be at least 1, got {n}")
    threads = threads or (1 if pin_cpus else blas.shared_threads(n))
    env = rank_environment(blas_choice, threads)  # what the rank would re-execute itself with
    log_dir = Path(tempfile.mkdtemp(prefix="cpchat-ranks-"))
    started: list[tuple[subprocess.Popen, Path, str]] = []
    for i in range(n):
        log_path = log_dir / f"rank{i}.log"
        cmd = [
            sys.executable,
            "-m",
            "cpchat",
            "rank",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--parent-pid",
            str(os.getpid()),
            "--blas",
            blas_choice,
            "--threads",
            str(threads),
            "--ranks-here",
            str(n),
            *flags,
        ]
        if pin_cpus:
            cmd += ["--cpu", str(i % os.cpu_count())]
        if devices:
            env = env | {"CUDA_VISIBLE_DEVICES": devices[i % len(devices)]}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        started.append((process, log_path, f"local rank {i} failed to start"))
    return wait_all_listening(started)


def wait_all_listening(started: list[tuple[subprocess.Popen, Path, str]]) -> list[LocalRank]:
    """The ranks of these (process, log, failure message) once each reports its address; on any
    failure, every one of them is stopped and LaunchError raised (see `wait_listening`)."""
    ranks: list[LocalRank] = []
    try:
        for i, (process, log_path, failure) in enumerate(started):
            ranks.append(LocalRank(i, process, wait_listening(process, log_path, failure), log_path))
    except BaseException:
        for process, _, _ in started:
            if process.poll() is None:
                process.kill()
            process.wait()
            process.stdout.close()
        raise
    return ranks


def wait_listening(process: subprocess.Popen, log_path: Path, failure: str) -> str:
    """The address a starting rank reports on stdout; LaunchError "failure: <its last words>" if it
    ends or stays silent for START_TIMEOUT_S."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = process.stdout.readline()
            if not line:
                break
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("event") == "listening":
                return message["address"]
        if process.poll() is not None:
            break
    process.kill()
    process.wait()
    raise LaunchError(f"{failure}: {_last_line(log_path) or 'no output'}")


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
