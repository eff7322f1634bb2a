from steerspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_new_tokens", "sampling", "seed", "k", "draft_top_k", "mode", "policy", "session_id", "steering", "verification", "tree", "stop", "draft_ahead", "ahead_outcomes", "ahead_budget_ms", "block_kind")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KIND_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    k: int
    draft_top_k: int
    mode: str
    policy: str
    session_id: str
    steering: bool
    verification: str
    tree: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    draft_ahead: str
    ahead_outcomes: int
    ahead_budget_ms: float
    block_kind: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., k: _Optional[int] = ..., draft_top_k: _Optional[int] = ..., mode: _Optional[str] = ..., policy: _Optional[str] = ..., session_id: _Optional[str] = ..., steering: _Optional[bool] = ..., verification: _Optional[str] = ..., tree: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., draft_ahead: _Optional[str] = ..., ahead_outcomes: _Optional[int] = ..., ahead_budget_ms: _Optional[float] = ..., block_kind: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("seq", "token_ids", "text", "accepted", "drafted")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    accepted: int
    drafted: int
    def __init__(self, seq: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., accepted: _Optional[int] = ..., drafted: _Optional[int] = ...) -> None: ...

class StageTimes(_message.Message):
    __slots__ = ("draft_ms", "network_ms", "queue_ms", "verify_ms", "overhead_ms")
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    draft_ms: float
    network_ms: float
    queue_ms: float
    verify_ms: float
    overhead_ms: float
    def __init__(self, draft_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ...) -> None: ...

class GenerationSummary(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "rounds", "drafted", "accepted", "block_efficiency", "acceptance_rate", "accepted_per_position", "tokens_per_s", "rtt_ms", "bytes_up", "bytes_down", "stage_ms", "wall_s", "finish_reason", "resumes", "trace_id", "lossy", "verification", "sprinter", "draft_compute_ms", "batch_size", "block_drafted", "block_accepted", "prompt_tokens", "ahead_blocks", "ahead_hits", "ahead_prepared", "ahead_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    SPRINTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_PREPARED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    rounds: int
    drafted: int
    accepted: int
    block_efficiency: float
    acceptance_rate: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[float]
    tokens_per_s: float
    rtt_ms: float
    bytes_up: float
    bytes_down: float
    stage_ms: StageTimes
    wall_s: float
    finish_reason: str
    resumes: int
    trace_id: str
    lossy: bool
    verification: str
    sprinter: SprinterTheory
    draft_compute_ms: float
    batch_size: float
    block_drafted: _containers.RepeatedScalarFieldContainer[int]
    block_accepted: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    ahead_blocks: int
    ahead_hits: int
    ahead_prepared: float
    ahead_ms: float
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., block_efficiency: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[float]] = ..., tokens_per_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., bytes_up: _Optional[float] = ..., bytes_down: _Optional[float] = ..., stage_ms: _Optional[_Union[StageTimes, _Mapping]] = ..., wall_s: _Optional[float] = ..., finish_reason: _Optional[str] = ..., resumes: _Optional[int] = ..., trace_id: _Optional[str] = ..., lossy: _Optional[bool] = ..., verification: _Optional[str] = ..., sprinter: _Optional[_Union[SprinterTheory, _Mapping]] = ..., draft_compute_ms: _Optional[float] = ..., batch_size: _Optional[float] = ..., block_drafted: _Optional[_Iterable[int]] = ..., block_accepted: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., ahead_blocks: _Optional[int] = ..., ahead_hits: _Optional[int] = ..., ahead_prepared: _Optional[float] = ..., ahead_ms: _Optional[float] = ...) -> None: ...

class SprinterTheory(_message.Message):
    __slots__ = ("eta_tp", "eta_fp", "tv_pq", "tv_bound", "mean_run_length", "expected_run_length", "labelled", "tv_measured")
    ETA_TP_FIELD_NUMBER: _ClassVar[int]
    ETA_FP_FIELD_NUMBER: _ClassVar[int]
    TV_PQ_FIELD_NUMBER: _ClassVar[int]
    TV_BOUND_FIELD_NUMBER: _ClassVar[int]
    MEAN_RUN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_RUN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LABELLED_FIELD_NUMBER: _ClassVar[int]
    TV_MEASURED_FIELD_NUMBER: _ClassVar[int]
    eta_tp: float
    eta_fp: float
    tv_pq: float
    tv_bound: float
    mean_run_length: float
    expected_run_length: float
    labelled: int
    tv_measured: float
    def __init__(self, eta_tp: _Optional[float] = ..., eta_fp: _Optional[float] = ..., tv_pq: _Optional[float] = ..., tv_bound: _Optional[float] = ..., mean_run_length: _Optional[float] = ..., expected_run_length: _Optional[float] = ..., labelled: _Optional[int] = ..., tv_measured: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "summary")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    summary: GenerationSummary
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., summary: _Optional[_Union[GenerationSummary, _Mapping]] = ...) -> None: ...
