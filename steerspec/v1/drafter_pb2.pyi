from steerspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpen(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "seed", "k", "draft_top_k", "policy", "steering", "max_new_tokens", "policy_state", "traceparent", "verification", "tree", "verifier", "draft_ahead", "ahead_outcomes", "ahead_budget_ms", "block_kind")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_STATE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KIND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    k: int
    draft_top_k: int
    policy: str
    steering: _common_pb2.Tensor
    max_new_tokens: int
    policy_state: str
    traceparent: str
    verification: str
    tree: str
    verifier: _common_pb2.ModelIdentity
    draft_ahead: str
    ahead_outcomes: int
    ahead_budget_ms: float
    block_kind: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., k: _Optional[int] = ..., draft_top_k: _Optional[int] = ..., policy: _Optional[str] = ..., steering: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., policy_state: _Optional[str] = ..., traceparent: _Optional[str] = ..., verification: _Optional[str] = ..., tree: _Optional[str] = ..., verifier: _Optional[_Union[_common_pb2.ModelIdentity, _Mapping]] = ..., draft_ahead: _Optional[str] = ..., ahead_outcomes: _Optional[int] = ..., ahead_budget_ms: _Optional[float] = ..., block_kind: _Optional[str] = ...) -> None: ...

class DraftFeedback(_message.Message):
    __slots__ = ("result", "want_block", "draft_ms", "network_ms", "traceparent")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    WANT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    result: _common_pb2.VerifyResult
    want_block: bool
    draft_ms: float
    network_ms: float
    traceparent: str
    def __init__(self, result: _Optional[_Union[_common_pb2.VerifyResult, _Mapping]] = ..., want_block: _Optional[bool] = ..., draft_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., traceparent: _Optional[str] = ...) -> None: ...

class DraftClose(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "feedback", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    feedback: DraftFeedback
    close: DraftClose
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., feedback: _Optional[_Union[DraftFeedback, _Mapping]] = ..., close: _Optional[_Union[DraftClose, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("block", "error")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    block: _common_pb2.DraftBlock
    error: _common_pb2.StreamError
    def __init__(self, block: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StreamError, _Mapping]] = ...) -> None: ...

class GetDrafterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _common_pb2.ServiceStats
    def __init__(self, stats: _Optional[_Union[_common_pb2.ServiceStats, _Mapping]] = ...) -> None: ...
