"""Start `cpchat rank` on other hosts over ssh, as `mlx.launch` does: with the user's own ssh config
and keys (`CPCHAT_SSH` replaces the `ssh` command, e.g. `ssh -F my_config`).

Each rank runs as `exec cpchat rank --host ADDRESS --port PORT --token-file /dev/stdin --parent-pid
$PPID` on its host. The token goes down ssh's stdin, never onto a command line; the rank's parent is
the ssh session on that host, so a rank whose session ends (the front end exits, is killed, or loses
the host) exits within half a second, as local ranks do when the front end dies. `CPCHAT_REMOTE_COMMAND`
replaces `cpchat` where it is not on the hosts' PATH (e.g. `/opt/venv/bin/python -m cpchat`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cpchat.client.launcher import LocalRank, wait_all_listening


@dataclass(frozen=True)
class Host:
    """One rank's host: what ssh connects to, and the address (and port; 0 = any free one) the rank
    binds and the other ranks dial."""

    ssh: str
    address: str
    port: int = 0


def parse_hosts(text: str, source: str) -> list[Host]:
    """A hostfile: lines of `host[:port]` (`#` comments), or mlx.launch's JSON list of
    `{"ssh": name, "ips": [address, ...]}`."""
    if text.lstrip().startswith("["):
        try:
            entries = json.loads(text)
            hosts = [Host(e["ssh"], (e.get("ips") or [e["ssh"]])[0]) for e in entries]
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"{source}: not an mlx.launch hostfile ({type(e).__name__}: {e})") from None
    else:
        hosts = []
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "0")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"{source}: expected host or host:port, got {entry!r}")
            hosts.append(Host(host, host, int(port)))
    if not hosts:
        raise ValueError(f"{source}: no hosts")
    return hosts


def ssh_command() -> list[str]:
    return shlex.split(os.environ.get("CPCHAT_SSH", "ssh")) + ["-o", "BatchMode=yes"]


def launch_remote_ranks(hosts: list[Host], token: str, threads: int | None = None) -> list[LocalRank]:
    """Start a rank on each host at once and wait until each reports its address; on any failure
    stop the ones that started and raise LaunchError naming the host. Ranks on one host share its
    cores out, unless `threads` says how many BLAS threads each runs."""
    remote = os.environ.get("CPCHAT_REMOTE_COMMAND", "cpchat")
    log_dir = Path(tempfile.mkdtemp(prefix="cpchat-ssh-ranks-"))
    started: list[tuple[subprocess.Popen, Path, str]] = []
    for i, host in enumerate(hosts):
        share = f"--ranks-here {sum(h.ssh == host.ssh for h in hosts)}"
        share += f" --threads {threads}" if threads else ""
        command = (f"exec {remote} rank --host {shlex.quote(host.address)} --port {host.port} "
                   f"--token-file /dev/stdin --parent-pid $PPID {share}")
        log_path = log_dir / f"rank{i}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen([*ssh_command(), host.ssh, command], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            process.stdin.write(token.encode())
            process.stdin.close()
        except OSError:
            pass  # ssh already gave up: its log says why
        started.append((process, log_path, f"cannot start a rank on {host.ssh} over ssh"))
    return wait_all_listening(started)
