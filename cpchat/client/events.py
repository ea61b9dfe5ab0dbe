"""What a generation reports to its front end (TUI or headless).

These plain dataclasses are the client's public vocabulary: the headless
`--json` events of docs/design.md §1 are exactly `asdict()` of those in EVENT_NAMES,
with an "event" key added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpchat import __version__


@dataclass
class RankAddress:
    rank: int
    address: str
    blas: str = ""  # the BLAS its CPU products run on, e.g. "OpenBLAS 0.3.21 Haswell"
    threads: int = 0  # the threads that BLAS runs, as it reports (--threads)
    speed: float = 0.0  # tokens a second its forward runs, as it measured when the model loaded
    stage: int = 0  # the pipeline stage it runs (--stages)
    layers: tuple[int, int] = (0, 0)  # the layers [first, last + 1] it runs
    weight_bytes: int = 0  # the weights it holds, as MLX counts them
    # its low-precision layers by how their CPU products run: "packed" (from the stored bytes) or
    # "float32"; with `products_note`, why none is packed where the kernels cannot run
    products: dict[str, int] = field(default_factory=dict)
    products_note: str = ""


@dataclass
class Ready:
    model: str
    ranks: list[RankAddress]
    version: str = __version__  # cpchat's
    transport: str = ""  # how tensors travel between the ranks: "mlx", "shm", "grpc", or a mix "shm+grpc"
    kv_bits: int = 0  # K/V quantized to this many bits (--kv-bits); 0: the model's dtype
    shares: str = "auto"  # how a prompt is shared out: auto (by the speeds), equal, or weights (--shares)
    stages: int = 1  # pipeline stages the ranks form (--stages)


@dataclass
class Prefill:
    turn: int
    new_tokens: int
    cached_tokens: int
    algorithm: str
    ms: float
    reason: str = ""  # why the algorithm ran: auto's least estimate, or forced
    estimates_ms: dict[str, float] = field(default_factory=dict)  # auto's estimate for each algorithm
    linear_layers: str = ""  # how linear-attention layers crossed the ring (models that have them)
    state_combine_ms: float = 0.0  # of ms: their halo exchange and state combine, on the reporting rank
    reused_tokens: int = 0  # the cached tokens: K/V held in the ranks' memory or loaded from their disks
    cache: str = "none"  # where they came from: "memory" | "disk" | "none"
    load_ms: float = 0.0  # finding and loading them from disk (before the prefill's ms)
    shares: list[int] = field(default_factory=list)  # the new tokens each rank took (--shares)
    # Pipeline stages (--stages): each rank's wait for the previous stage's hidden states, the
    # pipeline's bubble (0 on the first stage); empty for one stage.
    stage_wait_ms: list[float] = field(default_factory=list)


@dataclass
class CacheLoaded:
    """The ranks loaded a saved prefix from their disks (before the prefill of the rest; the
    `prefill` event says it too, as reused_tokens and cache "disk")."""

    turn: int
    tokens: int
    ms: float
    resharded: bool  # saved by a ring of another size, split anew among these ranks


@dataclass
class Token:
    turn: int
    id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and theirs, when asked (the server)


@dataclass
class RankUsage:
    rank: int
    kv_tokens: int
    kv_bytes: int
    rss_bytes: int
    state_bytes: int = 0  # recurrent states of linear-attention layers (the same on every rank)


@dataclass
class Speculated:
    """Speculative decoding over an answer: the mode that ran ("off" or "lookup"), the tokens proposed
    and accepted, and the decode steps that decided the answer's tokens after the first."""

    mode: str = "off"
    proposed: int = 0
    accepted: int = 0
    steps: int = 0


@dataclass
class Done:
    turn: int
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    ranks: list[RankUsage]
    speculation: Speculated = field(default_factory=Speculated)


@dataclass
class Error:
    message: str


@dataclass
class Progress:
    """A prefill under way: of `total` prompt tokens, `cached` were held already and `processed` of
    the new ones are done, counted layer-weighted (the ranks take the whole prompt layer by layer)."""

    turn: int
    total: int
    cached: int
    processed: int
    ms: float


EVENT_NAMES = {Ready: "ready", Progress: "progress", Prefill: "prefill", Token: "token", Done: "done",
               Error: "error"}


@dataclass
class RingStep:
    layer: int
    step: int
    compute_ms: float
    wait_ms: float
    bytes_sent: int


@dataclass
class RankStats:
    """One rank's live state, as its stats stream reports it."""

    rank: int
    address: str
    state: str  # "loading" | "ready" | "busy" | "failed"
    kv_tokens: int = 0
    kv_bytes: int = 0
    rss_bytes: int = 0
    mlx_active_bytes: int = 0
    mlx_peak_bytes: int = 0
    peak_rss_bytes: int = 0
    data_plane_bytes_sent: int = 0  # through the ranks' mx.distributed group (--transport mlx)
    state_bytes: int = 0  # recurrent states and convolution halos of linear-attention layers
    sequences: int = 0  # the conversations the rank holds (the counts above are all of theirs)
    algorithm: str = ""
    ring_steps: list[RingStep] = field(default_factory=list)
    error: str = ""
    blas: str = ""
    slow_blas: bool = False  # a CPU rank on the reference BLAS
    threads: int = 0  # BLAS threads


@dataclass
class AlgorithmChoice:
    """Why the algorithm of the last prefill was chosen (for the Ring panel and the prefill event):
    the cost model's estimate for each algorithm (cpchat/core/heuristics.py) and the quantities
    behind them."""

    algorithm: str
    forced: bool
    new_tokens: int
    cached_tokens: int
    miss_rate: float  # T / (T + P)
    estimates_ms: dict[str, float]
    reason: str
    link_bytes_per_s: float = 0.0
    hop_latency_ms: float = 0.0
    exchange_latency_ms: float = 0.0


Event = CacheLoaded | Prefill | Progress | Token | Done  # what a session's generation yields
