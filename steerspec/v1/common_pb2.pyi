from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs", "support")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    support: int
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ..., support: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("seq", "committed_length", "draft_ids", "q", "draft_ms", "policy_state", "traceparent", "kept", "head_kept", "sprinter_lambda", "ahead", "ahead_hit", "ahead_prepared", "ahead_ms", "parents")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    HEAD_KEPT_FIELD_NUMBER: _ClassVar[int]
    SPRINTER_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_PREPARED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    committed_length: int
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDistribution
    draft_ms: float
    policy_state: str
    traceparent: str
    kept: int
    head_kept: int
    sprinter_lambda: float
    ahead: bool
    ahead_hit: bool
    ahead_prepared: int
    ahead_ms: float
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., committed_length: _Optional[int] = ..., draft_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDistribution, _Mapping]] = ..., draft_ms: _Optional[float] = ..., policy_state: _Optional[str] = ..., traceparent: _Optional[str] = ..., kept: _Optional[int] = ..., head_kept: _Optional[int] = ..., sprinter_lambda: _Optional[float] = ..., ahead: _Optional[bool] = ..., ahead_hit: _Optional[bool] = ..., ahead_prepared: _Optional[int] = ..., ahead_ms: _Optional[float] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class SprinterLabels(_message.Message):
    __slots__ = ("tp", "fn", "fp", "tn", "r", "tv_pq_sum", "moved_sum")
    TP_FIELD_NUMBER: _ClassVar[int]
    FN_FIELD_NUMBER: _ClassVar[int]
    FP_FIELD_NUMBER: _ClassVar[int]
    TN_FIELD_NUMBER: _ClassVar[int]
    R_FIELD_NUMBER: _ClassVar[int]
    TV_PQ_SUM_FIELD_NUMBER: _ClassVar[int]
    MOVED_SUM_FIELD_NUMBER: _ClassVar[int]
    tp: int
    fn: int
    fp: int
    tn: int
    r: int
    tv_pq_sum: float
    moved_sum: float
    def __init__(self, tp: _Optional[int] = ..., fn: _Optional[int] = ..., fp: _Optional[int] = ..., tn: _Optional[int] = ..., r: _Optional[int] = ..., tv_pq_sum: _Optional[float] = ..., moved_sum: _Optional[float] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("seq", "accepted", "next_token", "is_bonus", "committed_length", "steering", "queue_ms", "verify_ms", "batch_size", "sprinter", "path", "pass_rows", "blocks_waiting", "cost_fixed_ms", "cost_per_row_ms", "cost_per_block_ms", "cost_row_bucket", "cost_block_rows", "cost_per_branched_row_ms")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IS_BONUS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPRINTER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WAITING_FIELD_NUMBER: _ClassVar[int]
    COST_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_ROW_MS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_BLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    COST_ROW_BUCKET_FIELD_NUMBER: _ClassVar[int]
    COST_BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    COST_PER_BRANCHED_ROW_MS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    accepted: int
    next_token: int
    is_bonus: bool
    committed_length: int
    steering: Tensor
    queue_ms: float
    verify_ms: float
    batch_size: int
    sprinter: SprinterLabels
    path: _containers.RepeatedScalarFieldContainer[int]
    pass_rows: int
    blocks_waiting: int
    cost_fixed_ms: float
    cost_per_row_ms: float
    cost_per_block_ms: float
    cost_row_bucket: int
    cost_block_rows: float
    cost_per_branched_row_ms: float
    def __init__(self, seq: _Optional[int] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., is_bonus: _Optional[bool] = ..., committed_length: _Optional[int] = ..., steering: _Optional[_Union[Tensor, _Mapping]] = ..., queue_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., sprinter: _Optional[_Union[SprinterLabels, _Mapping]] = ..., path: _Optional[_Iterable[int]] = ..., pass_rows: _Optional[int] = ..., blocks_waiting: _Optional[int] = ..., cost_fixed_ms: _Optional[float] = ..., cost_per_row_ms: _Optional[float] = ..., cost_per_block_ms: _Optional[float] = ..., cost_row_bucket: _Optional[int] = ..., cost_block_rows: _Optional[float] = ..., cost_per_branched_row_ms: _Optional[float] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "seq")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    seq: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ServiceStats(_message.Message):
    __slots__ = ("active_sessions", "cache_bytes", "max_sessions", "max_cache_bytes", "blocks_total", "model", "identity", "passes_total", "rows_total", "busy_s")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PASSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    cache_bytes: int
    max_sessions: int
    max_cache_bytes: int
    blocks_total: int
    model: str
    identity: ModelIdentity
    passes_total: int
    rows_total: int
    busy_s: float
    def __init__(self, active_sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_cache_bytes: _Optional[int] = ..., blocks_total: _Optional[int] = ..., model: _Optional[str] = ..., identity: _Optional[_Union[ModelIdentity, _Mapping]] = ..., passes_total: _Optional[int] = ..., rows_total: _Optional[int] = ..., busy_s: _Optional[float] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "tokenizer", "vocab_size", "context_length", "eos_ids", "hidden_size", "steering", "steering_layers", "steering_hidden_size", "draft_support")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    STEERING_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STEERING_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokenizer: str
    vocab_size: int
    context_length: int
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    steering: str
    steering_layers: _containers.RepeatedScalarFieldContainer[int]
    steering_hidden_size: int
    draft_support: int
    def __init__(self, name: _Optional[str] = ..., tokenizer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., eos_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., steering: _Optional[str] = ..., steering_layers: _Optional[_Iterable[int]] = ..., steering_hidden_size: _Optional[int] = ..., draft_support: _Optional[int] = ...) -> None: ...
