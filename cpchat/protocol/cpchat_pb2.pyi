from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Algorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALGORITHM_UNSPECIFIED: _ClassVar[Algorithm]
    PASS_KV: _ClassVar[Algorithm]
    PASS_Q: _ClassVar[Algorithm]
    ALL_GATHER: _ClassVar[Algorithm]
    ULYSSES: _ClassVar[Algorithm]

class Decode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_UNSPECIFIED: _ClassVar[Decode]
    DECODE_EXCHANGE: _ClassVar[Decode]
    DECODE_RING: _ClassVar[Decode]
    DECODE_LEAD: _ClassVar[Decode]
    DECODE_GATHER: _ClassVar[Decode]

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_OFF: _ClassVar[Speculation]
    SPECULATION_LOOKUP: _ClassVar[Speculation]
    SPECULATION_DRAFT: _ClassVar[Speculation]

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    KV: _ClassVar[FrameKind]
    QUERY: _ClassVar[FrameKind]
    PARTIAL: _ClassVar[FrameKind]
    TOKEN: _ClassVar[FrameKind]
    PROBE: _ClassVar[FrameKind]
    GATHER: _ClassVar[FrameKind]
    HEADS: _ClassVar[FrameKind]
    OUTPUT: _ClassVar[FrameKind]
    HALO: _ClassVar[FrameKind]
    STATE: _ClassVar[FrameKind]
    SHARD: _ClassVar[FrameKind]
    NEW_KV: _ClassVar[FrameKind]
    HIDDEN: _ClassVar[FrameKind]
    DRAFT: _ClassVar[FrameKind]
ALGORITHM_UNSPECIFIED: Algorithm
PASS_KV: Algorithm
PASS_Q: Algorithm
ALL_GATHER: Algorithm
ULYSSES: Algorithm
DECODE_UNSPECIFIED: Decode
DECODE_EXCHANGE: Decode
DECODE_RING: Decode
DECODE_LEAD: Decode
DECODE_GATHER: Decode
SPECULATION_OFF: Speculation
SPECULATION_LOOKUP: Speculation
SPECULATION_DRAFT: Speculation
FRAME_KIND_UNSPECIFIED: FrameKind
KV: FrameKind
QUERY: FrameKind
PARTIAL: FrameKind
TOKEN: FrameKind
PROBE: FrameKind
GATHER: FrameKind
HEADS: FrameKind
OUTPUT: FrameKind
HALO: FrameKind
STATE: FrameKind
SHARD: FrameKind
NEW_KV: FrameKind
HIDDEN: FrameKind
DRAFT: FrameKind

class ConfigureRequest(_message.Message):
    __slots__ = ("rank", "addresses", "ring_id", "shm_endpoints", "data_plane_backend", "data_plane_addresses")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RING_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    ring_id: str
    shm_endpoints: _containers.RepeatedScalarFieldContainer[str]
    data_plane_backend: str
    data_plane_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., ring_id: _Optional[str] = ..., shm_endpoints: _Optional[_Iterable[str]] = ..., data_plane_backend: _Optional[str] = ..., data_plane_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ConfigureReply(_message.Message):
    __slots__ = ("transports",)
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transports: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "kv_bits", "kv_group_size", "quantized_kv_start", "stages", "stage_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_KV_START_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    STAGE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    kv_bits: int
    kv_group_size: int
    quantized_kv_start: int
    stages: int
    stage_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., quantized_kv_start: _Optional[int] = ..., stages: _Optional[int] = ..., stage_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("stage", "model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size", "bytes_per_element", "max_context", "value_dim", "state_layers", "kv_bits", "kv_group_size", "weight_bytes", "pipeline_stage", "first_layer", "end_layer", "packed_layers", "float32_layers", "products_note")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VALUE_DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    PACKED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRODUCTS_NOTE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_element: int
    max_context: int
    value_dim: int
    state_layers: int
    kv_bits: int
    kv_group_size: int
    weight_bytes: int
    pipeline_stage: int
    first_layer: int
    end_layer: int
    packed_layers: int
    float32_layers: int
    products_note: str
    def __init__(self, stage: _Optional[str] = ..., model_type: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_q_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., bytes_per_element: _Optional[int] = ..., max_context: _Optional[int] = ..., value_dim: _Optional[int] = ..., state_layers: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., pipeline_stage: _Optional[int] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., packed_layers: _Optional[int] = ..., float32_layers: _Optional[int] = ..., products_note: _Optional[str] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("probe_bytes", "rounds")
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    probe_bytes: int
    rounds: int
    def __init__(self, probe_bytes: _Optional[int] = ..., rounds: _Optional[int] = ...) -> None: ...

class CalibrateReply(_message.Message):
    __slots__ = ("flops_per_s", "ring_bytes_per_s", "prefill_fixed_s", "prefill_per_token_s", "prefill_per_pair_s", "prefill_per_masked_pair_s", "decode_step_s", "link_latency_s", "exchange_latency_s", "forward_fixed_bytes", "forward_per_token_bytes")
    FLOPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PER_PAIR_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PER_MASKED_PAIR_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    LINK_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PER_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    flops_per_s: float
    ring_bytes_per_s: float
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    prefill_per_masked_pair_s: float
    decode_step_s: float
    link_latency_s: _containers.RepeatedScalarFieldContainer[float]
    exchange_latency_s: float
    forward_fixed_bytes: float
    forward_per_token_bytes: float
    def __init__(self, flops_per_s: _Optional[float] = ..., ring_bytes_per_s: _Optional[float] = ..., prefill_fixed_s: _Optional[float] = ..., prefill_per_token_s: _Optional[float] = ..., prefill_per_pair_s: _Optional[float] = ..., prefill_per_masked_pair_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., link_latency_s: _Optional[_Iterable[float]] = ..., exchange_latency_s: _Optional[float] = ..., forward_fixed_bytes: _Optional[float] = ..., forward_per_token_bytes: _Optional[float] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "keep_tokens", "tokens", "algorithm", "max_tokens", "sampling", "stop_tokens", "decode", "save_prefix", "keep_state_at", "shares", "speculation", "draft_tokens", "draft_model", "sequence")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    SAVE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEEP_STATE_AT_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keep_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    algorithm: Algorithm
    max_tokens: int
    sampling: Sampling
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    decode: Decode
    save_prefix: bool
    keep_state_at: int
    shares: _containers.RepeatedScalarFieldContainer[int]
    speculation: Speculation
    draft_tokens: int
    draft_model: str
    sequence: str
    def __init__(self, request_id: _Optional[str] = ..., keep_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., algorithm: _Optional[_Union[Algorithm, str]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., decode: _Optional[_Union[Decode, str]] = ..., save_prefix: _Optional[bool] = ..., keep_state_at: _Optional[int] = ..., shares: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., draft_tokens: _Optional[int] = ..., draft_model: _Optional[str] = ..., sequence: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "rows")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    rows: _containers.RepeatedCompositeFieldContainer[StepRow]
    def __init__(self, step_id: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[StepRow, _Mapping]]] = ...) -> None: ...

class StepRow(_message.Message):
    __slots__ = ("sequence", "token", "index", "sampling", "shares")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    sequence: str
    token: int
    index: int
    sampling: Sampling
    shares: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence: _Optional[str] = ..., token: _Optional[int] = ..., index: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., shares: _Optional[_Iterable[int]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("prefill", "token", "done", "progress")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillDone
    token: TokenEvent
    done: GenerateDone
    progress: LayerProgress
    def __init__(self, prefill: _Optional[_Union[PrefillDone, _Mapping]] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., done: _Optional[_Union[GenerateDone, _Mapping]] = ..., progress: _Optional[_Union[LayerProgress, _Mapping]] = ...) -> None: ...

class LayerProgress(_message.Message):
    __slots__ = ("layer", "num_layers")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    num_layers: int
    def __init__(self, layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("ms", "linear_layers", "state_combine_ms", "stage_wait_ms")
    MS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_COMBINE_MS_FIELD_NUMBER: _ClassVar[int]
    STAGE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ms: float
    linear_layers: str
    state_combine_ms: float
    stage_wait_ms: float
    def __init__(self, ms: _Optional[float] = ..., linear_layers: _Optional[str] = ..., state_combine_ms: _Optional[float] = ..., stage_wait_ms: _Optional[float] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("id", "logprob", "top_ids", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateDone(_message.Message):
    __slots__ = ("kv_tokens", "kv_bytes", "rss_bytes", "cached_tokens", "cancelled", "keep_floor", "state_bytes", "state_positions", "proposed", "accepted", "decode_steps")
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    KEEP_FLOOR_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    kv_tokens: int
    kv_bytes: int
    rss_bytes: int
    cached_tokens: int
    cancelled: bool
    keep_floor: int
    state_bytes: int
    state_positions: _containers.RepeatedScalarFieldContainer[int]
    proposed: int
    accepted: int
    decode_steps: int
    def __init__(self, kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cancelled: _Optional[bool] = ..., keep_floor: _Optional[int] = ..., state_bytes: _Optional[int] = ..., state_positions: _Optional[_Iterable[int]] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("interval_s", "once")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ONCE_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    once: bool
    def __init__(self, interval_s: _Optional[float] = ..., once: _Optional[bool] = ...) -> None: ...

class RingStep(_message.Message):
    __slots__ = ("layer", "step", "compute_ms", "wait_ms", "bytes_sent")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    step: int
    compute_ms: float
    wait_ms: float
    bytes_sent: int
    def __init__(self, layer: _Optional[int] = ..., step: _Optional[int] = ..., compute_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("rank", "state", "kv_tokens", "kv_bytes", "rss_bytes", "mlx_active_bytes", "mlx_peak_bytes", "algorithm", "ring_steps", "peak_rss_bytes", "data_plane_bytes_sent", "state_bytes", "sequences")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    RING_STEPS_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: str
    kv_tokens: int
    kv_bytes: int
    rss_bytes: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    algorithm: str
    ring_steps: _containers.RepeatedCompositeFieldContainer[RingStep]
    peak_rss_bytes: int
    data_plane_bytes_sent: int
    state_bytes: int
    sequences: int
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[str] = ..., kv_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., mlx_active_bytes: _Optional[int] = ..., mlx_peak_bytes: _Optional[int] = ..., algorithm: _Optional[str] = ..., ring_steps: _Optional[_Iterable[_Union[RingStep, _Mapping]]] = ..., peak_rss_bytes: _Optional[int] = ..., data_plane_bytes_sent: _Optional[int] = ..., state_bytes: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("keep_tokens", "sequence", "every")
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    keep_tokens: int
    sequence: str
    every: bool
    def __init__(self, keep_tokens: _Optional[int] = ..., sequence: _Optional[str] = ..., every: _Optional[bool] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ("kv_tokens",)
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_tokens: int
    def __init__(self, kv_tokens: _Optional[int] = ...) -> None: ...

class FindPrefixesRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SavedPrefix(_message.Message):
    __slots__ = ("prefix_id", "num_ranks", "shard", "tokens", "common", "floor", "state_positions")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMON_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    STATE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    num_ranks: int
    shard: int
    tokens: int
    common: int
    floor: int
    state_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefix_id: _Optional[str] = ..., num_ranks: _Optional[int] = ..., shard: _Optional[int] = ..., tokens: _Optional[int] = ..., common: _Optional[int] = ..., floor: _Optional[int] = ..., state_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class FindPrefixesReply(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[SavedPrefix]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[SavedPrefix, _Mapping]]] = ...) -> None: ...

class LoadPrefixRequest(_message.Message):
    __slots__ = ("prefix_id", "num_ranks", "tokens", "sequence")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    num_ranks: int
    tokens: int
    sequence: str
    def __init__(self, prefix_id: _Optional[str] = ..., num_ranks: _Optional[int] = ..., tokens: _Optional[int] = ..., sequence: _Optional[str] = ...) -> None: ...

class LoadPrefixReply(_message.Message):
    __slots__ = ("kv_tokens", "keep_floor", "state_positions")
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FLOOR_FIELD_NUMBER: _ClassVar[int]
    STATE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    kv_tokens: int
    keep_floor: int
    state_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_tokens: _Optional[int] = ..., keep_floor: _Optional[int] = ..., state_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadDraftRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LoadDraftReply(_message.Message):
    __slots__ = ("weight_bytes", "token_bytes", "tokens_held")
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    weight_bytes: int
    token_bytes: int
    tokens_held: int
    def __init__(self, weight_bytes: _Optional[int] = ..., token_bytes: _Optional[int] = ..., tokens_held: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("state", "rank", "pid", "blas", "shm_endpoint", "cpu_cores", "computes_on_cpu", "data_plane_backends", "data_plane_port", "memory_free_bytes", "cpu_allowance")
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    SHM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    COMPUTES_ON_CPU_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_PORT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    state: str
    rank: int
    pid: int
    blas: Blas
    shm_endpoint: str
    cpu_cores: int
    computes_on_cpu: bool
    data_plane_backends: _containers.RepeatedScalarFieldContainer[str]
    data_plane_port: int
    memory_free_bytes: int
    cpu_allowance: float
    def __init__(self, state: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., blas: _Optional[_Union[Blas, _Mapping]] = ..., shm_endpoint: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., computes_on_cpu: _Optional[bool] = ..., data_plane_backends: _Optional[_Iterable[str]] = ..., data_plane_port: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., cpu_allowance: _Optional[float] = ...) -> None: ...

class Blas(_message.Message):
    __slots__ = ("name", "version", "library", "fix", "threads")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    FIX_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    library: str
    fix: str
    threads: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., library: _Optional[str] = ..., fix: _Optional[str] = ..., threads: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class Beat(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Frame(_message.Message):
    __slots__ = ("ring_id", "request_id", "layer", "step", "kind", "source_rank", "tensor_index", "tensor_count", "chunk_index", "chunk_count", "dtype", "shape", "data", "data_plane_bytes", "data_plane_seq")
    RING_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_SEQ_FIELD_NUMBER: _ClassVar[int]
    ring_id: str
    request_id: str
    layer: int
    step: int
    kind: FrameKind
    source_rank: int
    tensor_index: int
    tensor_count: int
    chunk_index: int
    chunk_count: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    data_plane_bytes: int
    data_plane_seq: int
    def __init__(self, ring_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layer: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., source_rank: _Optional[int] = ..., tensor_index: _Optional[int] = ..., tensor_count: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., data_plane_bytes: _Optional[int] = ..., data_plane_seq: _Optional[int] = ...) -> None: ...

class LinkClosed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
