"""Form the ring a front end asked for: local ranks launched here, or running ones attached."""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cpchat.client.cluster import Cluster, parse_addresses, read_hostfile
from cpchat.client.launcher import LaunchError
from cpchat.client.remote import launch_remote_ranks, parse_hosts
from cpchat.errors import BackendError, BadInput


@dataclass(frozen=True)
class ClusterOptions:
    """Where the ranks are: local ones launched here, the `attach` list / `hostfile` of running ones, or
    (with `launch`) ranks this front end starts on the hostfile's hosts over ssh."""

    attach: str | None = None  # "host:port,host:port"
    hostfile: str | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    transport: str = "auto"  # one of cluster.TRANSPORTS
    launch: bool = False  # start the hostfile's ranks over ssh (cpchat/client/remote.py)
    devices: str = "all"  # GPUs local ranks are pinned to, one per rank in turn (launcher.rank_devices)

    @property
    def attached(self) -> bool:
        return bool(self.attach or self.hostfile)


def read_token(path: str) -> str:
    """The shared secret in `path`; warns when others may read the file."""
    try:
        mode = os.stat(path).st_mode
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise BadInput(f"cannot read token file {path}: {e.strerror}") from None
    if not token:
        raise BadInput(f"token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"cpchat: warning: token file {path} is readable by others (chmod 600 it)", file=sys.stderr)
    return token


def read_bytes(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise BadInput(f"cannot read {what} {path}: {e.strerror}") from None


def connect_cluster(options: ClusterOptions, ranks: int, blas_choice: str = "auto",
                    flags: Sequence[str] = (), threads: int | None = None) -> Cluster:
    """Launch `ranks` local ranks with that BLAS, `threads` BLAS threads each (default: the cores
    shared out) and `flags`, or attach to running ones, and form the ring."""
    token = read_token(options.token_file) if options.token_file else None
    tls_ca = read_bytes(options.tls_ca, "CA certificate")
    if options.launch:
        cluster = launch_over_ssh(options, token or secrets.token_urlsafe(32), threads)
    elif options.attached:
        addresses = parse_addresses(options.attach) if options.attach else read_hostfile(options.hostfile)
        cluster = Cluster(addresses, token=token, tls_ca=tls_ca, transport=options.transport)
    else:
        cluster = Cluster.launch(ranks, blas_choice, transport=options.transport, devices=options.devices,
                                 flags=flags, threads=threads)
    try:
        cluster.connect()
    except BaseException:
        cluster.close()
        raise
    return cluster


def launch_over_ssh(options: ClusterOptions, token: str, threads: int | None = None) -> Cluster:
    """Ranks started on the hostfile's hosts (a fresh token unless one is given); they stop with the
    front end."""
    if not options.hostfile:
        raise BadInput("--launch needs --hostfile: the hosts to start ranks on")
    if options.tls_ca:
        raise BadInput("--launch starts ranks without TLS: start TLS ranks by hand and --attach them")
    try:
        hosts = parse_hosts(Path(options.hostfile).read_text(encoding="utf-8"), options.hostfile)
    except OSError as e:
        raise BadInput(f"cannot read hostfile {options.hostfile}: {e.strerror}") from None
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        ranks = launch_remote_ranks(hosts, token, threads)
    except LaunchError as e:
        raise BackendError(str(e)) from None
    return Cluster([r.address for r in ranks], token=token, local=ranks, transport=options.transport)


def is_loopback(host: str) -> bool:
    """Whether an address to listen on reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
