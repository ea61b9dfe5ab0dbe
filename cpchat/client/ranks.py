"""The ranks as the front end holds them: a handle on each (its channel and what it told us), the model
they serve, and how a rank's failed call is told to the user."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from cpchat.blas import BlasInfo
from cpchat.client.launcher import LocalRank
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol import cpchat_pb2_grpc as pb_grpc


@dataclass
class ServedModel:
    """The model every rank has loaded, as their LoadModel replies describe it."""

    name: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    vocab_size: int
    bytes_per_element: int
    max_context: int
    head_dim: int = 0
    value_dim: int = 0
    state_layers: int = 0  # of num_layers, those with a recurrent state instead of K/V
    kv_format: KVFormat = FULL_PRECISION  # how the ranks keep K/V (--kv-bits)
    weight_bytes: int = 0  # on the rank that holds the most
    stages: int = 1  # pipeline stages the ranks form (--stages)

    @property
    def attention_layers(self) -> int:
        """The layers that keep K/V and attend (the others keep a recurrent state)."""
        return self.num_layers - self.state_layers

    @property
    def groups(self) -> int:
        """Query heads that share a key head."""
        return max(self.num_q_heads // max(self.num_kv_heads, 1), 1)


@dataclass(frozen=True)
class DraftHeld:
    """A draft model on the rank that samples (--speculate draft:MODEL), as its LoadDraft reply says."""

    weight_bytes: int
    token_bytes: int  # what a token of the conversation adds to its cache
    tokens: int  # the tokens its cache holds now

    def need(self, tokens: int) -> int:
        """Bytes more it takes to hold a conversation of `tokens` (its cache is cut to what it shares)."""
        return max(tokens - self.tokens, 0) * self.token_bytes


@dataclass
class RankHandle:
    rank: int
    address: str
    channel: grpc.Channel
    control: pb_grpc.ControlStub
    local: LocalRank | None = None
    state: str = "starting"
    blas: pb.Blas = field(default_factory=pb.Blas)  # from Health, at connect
    cpu_cores: int = 0  # from Health: the cores it may run on
    cpu_allowance: float = 0.0  # from Health (again at each calibration): cores' worth of CPU time
    computes_on_cpu: bool = False  # from Health: no accelerator
    data_plane_backends: tuple[str, ...] = ()  # from Health: mx.distributed backends, fastest first
    data_plane_port: int = 0  # from Health
    stage: int = 0  # from LoadModel: the pipeline stage it runs
    layers: tuple[int, int] = (0, 0)  # from LoadModel: the layers [first, end) it runs
    weight_bytes: int = 0  # from LoadModel: the weights it holds
    state_layers: int = 0  # from LoadModel: of its layers, those with a recurrent state
    products: dict[str, int] = field(default_factory=dict)  # from LoadModel: its layers by product path
    products_note: str = ""  # from LoadModel: why none is packed, where the kernels cannot run

    @property
    def host(self) -> str:
        """The address without its port."""
        return self.address.rsplit(":", 1)[0]

    @property
    def label(self) -> str:
        return f"rank {self.rank} ({self.address})"

    @property
    def blas_label(self) -> str:
        return BlasInfo(self.blas.name, self.blas.version, self.blas.library).label if self.blas.name else ""

    @property
    def slow_blas(self) -> bool:
        """A CPU rank on the reference BLAS: Health then carries the command that fixes it."""
        return bool(self.blas.fix)


def describe_failure(r: RankHandle, e: grpc.RpcError, phase: str = "", connecting: bool = False,
                     tls: bool = False) -> str:
    """One line for a rank's failed call: which rank, and what went wrong, as the user can act on it."""
    code = e.code()
    where = f" during {phase}" if phase else ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        detail = e.details() or ""
        if "CERTIFICATE_VERIFY_FAILED" in detail or "andshake" in detail:
            return f"{r.label} failed the TLS check: its certificate is not signed by the --tls-ca given"
        if connecting:
            tls_hint = "Socket closed" in detail and not tls
            hint = " (if it serves TLS, pass --tls-ca)" if tls_hint else ""
            return f"{r.label} is unreachable{hint}"
        return f"{r.label} stopped answering{where}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{r.label} refused the connection: wrong or missing token"
    return f"{r.label}: {e.details() or code.name}"

