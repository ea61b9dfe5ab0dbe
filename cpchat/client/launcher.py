"""Start local `cpchat rank` processes on free loopback ports.

Ranks watch our pid and exit when we die (also on SIGKILL), so they never
outlive the front end. Where Debian's OpenBLAS is installed, ranks get it
through LD_PRELOAD: the mlx[cpu] wheel's reference BLAS is ~30x slower.
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
from dataclasses import dataclass
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
START_TIMEOUT_S = 60.0


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


def rank_environment(fast_blas: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    if fast_blas and OPENBLAS.exists() and str(OPENBLAS) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [str(OPENBLAS), env.get("LD_PRELOAD")]))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch_local_ranks(n: int, fast_blas: bool = True, pin_cpus: bool = False) -> list[LocalRank]:
    """Start n ranks at once and wait until each reports its address.
    With pin_cpus, rank i runs on core i (modulo the cores there are)."""
    if n < 1:
        raise LaunchError(f"--ranks must be at least 1, got {n}")
    env = rank_environment(fast_blas)
    log_dir = Path(tempfile.mkdtemp(prefix="cpchat-ranks-"))
    started: list[tuple[int, subprocess.Popen, Path]] = []
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
        ]
        if pin_cpus:
            cmd += ["--cpu", str(i % os.cpu_count())]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        started.append((i, process, log_path))
    ranks: list[LocalRank] = []
    try:
        for i, process, log_path in started:
            ranks.append(LocalRank(i, process, _wait_listening(i, process, log_path), log_path))
    except BaseException:
        for _, process, _ in started:
            process.kill()
            process.wait()
            process.stdout.close()
        raise
    return ranks


def _wait_listening(index: int, process: subprocess.Popen, log_path: Path) -> str:
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
    raise LaunchError(f"local rank {index} failed to start: {_last_line(log_path) or 'no output'}")


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
