"""Form the ring a front end asked for: local ranks launched here, or running ones attached."""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from cpchat.client.cluster import BadInput, Cluster, parse_addresses, read_hostfile


@dataclass(frozen=True)
class ClusterOptions:
    """Where the ranks are: local ones launched here, or the `attach` list / `hostfile` of running ones."""

    attach: str | None = None  # "host:port,host:port"
    hostfile: str | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    transport: str = "auto"  # one of cluster.TRANSPORTS

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


def connect_cluster(options: ClusterOptions, ranks: int, blas_choice: str = "auto") -> Cluster:
    """Launch `ranks` local ranks with that BLAS, or attach to running ones, and form the ring."""
    token = read_token(options.token_file) if options.token_file else None
    tls_ca = read_bytes(options.tls_ca, "CA certificate")
    if options.attached:
        addresses = parse_addresses(options.attach) if options.attach else read_hostfile(options.hostfile)
        cluster = Cluster(addresses, token=token, tls_ca=tls_ca, transport=options.transport)
    else:
        cluster = Cluster.launch(ranks, blas_choice, transport=options.transport)
    try:
        cluster.connect()
    except BaseException:
        cluster.close()
        raise
    return cluster
