"""Rank processes that tests start, signal and kill themselves, and the files they need
(token, TLS certificates). Every start is bounded by a deadline; `stop` always reaps."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from cpchat import blas
from cpchat.client.cluster import Cluster
from cpchat.client.launcher import rank_environment

CPCHAT = [sys.executable, "-m", "cpchat"]
START_TIMEOUT_S = 90.0


@dataclass
class RankProc:
    process: subprocess.Popen
    address: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """Kill and reap, also a stopped (SIGSTOP) rank."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=30)
        self.process.stdout.close()


def start_ranks(
    n: int,
    tmp: Path,
    *,
    token_file: Path | None = None,
    tls: dict[str, Path] | None = None,
    hosts: list[str] | None = None,
    port: int = 0,
    prefix: list[list[str]] | None = None,
    args: list[list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> list[RankProc]:
    """Start n `cpchat rank` processes at once and wait for each one's "listening" line.
    `prefix[i]` runs rank i under a wrapper (e.g. `ip netns exec NS`); `args[i]` are more flags."""
    started = []
    env = rank_environment(threads=blas.usable_cores()) if env is None else env
    for i in range(n):
        cmd = CPCHAT + ["rank", "--host", hosts[i] if hosts else "127.0.0.1", "--port", str(port)]
        cmd += args[i] if args else []
        if token_file:
            cmd += ["--token-file", str(token_file)]
        for flag, key in (("--tls-cert", "cert"), ("--tls-key", "key"), ("--tls-ca", "ca")):
            if tls and key in tls:
                cmd += [flag, str(tls[key])]
        log = tmp / f"rank-{time.monotonic_ns()}-{i}.log"
        with open(log, "wb") as err:
            process = subprocess.Popen((prefix[i] if prefix else []) + cmd, stdout=subprocess.PIPE,
                                       stderr=err, stdin=subprocess.DEVNULL, env=env, text=True)
        started.append((process, log))
    ranks = []
    try:
        for process, log in started:
            ranks.append(RankProc(process, wait_listening(process, log), log))
    except BaseException:
        for process, _ in started:
            process.kill()
            process.wait()
        raise
    return ranks


def wait_listening(process: subprocess.Popen, log: Path) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=0.2):
            line = process.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)["address"]
    raise RuntimeError(f"rank did not start: {log.read_text()[-2000:]}")


def stop_all(ranks: list[RankProc]) -> None:
    for r in ranks:
        r.stop()


@contextlib.contextmanager
def loaded_ring(ranks: list[RankProc], model: Path, token: str | None = None) -> Iterator[Cluster]:
    """A cluster on ranks a test started, `model` loaded; closed, and the ranks stopped, after."""
    cluster = Cluster([r.address for r in ranks], token=token)
    try:
        cluster.connect()
        cluster.load(str(model))
        yield cluster
    finally:
        cluster.close()
        stop_all(ranks)


def write_token(path: Path, token: str = "s3cret-cluster-token", mode: int = 0o600) -> Path:
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def make_certs(directory: Path, ips: list[str], name: str = "ca") -> dict[str, Path]:
    """A CA and a server certificate for `ips` (subjectAltName), with the openssl CLI."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (directory / f for f in (f"{name}.key", f"{name}.pem", "rank.key",
                                                          "rank.csr", "rank.pem"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "2", "-subj", f"/CN=cpchat test {name}")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=cpchat rank")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return {"ca": ca, "cert": cert, "key": key}


def ranks_started_with(flag: str, accept: Callable[[str], bool]) -> list[psutil.Process]:
    """The `cpchat rank` processes, in any namespace, whose command line gives `flag` a value
    that `accept` takes (the --parent-pid of a front end, the --port of launched ranks)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "rank" in cmd and flag in cmd[:-1] and accept(cmd[cmd.index(flag) + 1]):
            found.append(p)
    return found


def wait_gone(find: Callable[[], list[psutil.Process]], timeout: float = 10.0) -> list[psutil.Process]:
    """The processes `find` still lists alive after `timeout`; none once all have exited."""
    deadline = time.monotonic() + timeout
    while alive := [p for p in find() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        if time.monotonic() > deadline:
            return alive
        psutil.wait_procs(alive, timeout=0.1)
    return []
