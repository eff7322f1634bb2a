from steerspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyOpen(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "seed", "max_k", "steering", "verification", "tree", "client_model", "block_kind")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KIND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    max_k: int
    steering: bool
    verification: str
    tree: str
    client_model: _common_pb2.ModelIdentity
    block_kind: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., max_k: _Optional[int] = ..., steering: _Optional[bool] = ..., verification: _Optional[str] = ..., tree: _Optional[str] = ..., client_model: _Optional[_Union[_common_pb2.ModelIdentity, _Mapping]] = ..., block_kind: _Optional[str] = ...) -> None: ...

class VerifyClose(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("open", "block", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: VerifyOpen
    block: _common_pb2.DraftBlock
    close: VerifyClose
    def __init__(self, open: _Optional[_Union[VerifyOpen, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., close: _Optional[_Union[VerifyClose, _Mapping]] = ...) -> None: ...

class VerifyReady(_message.Message):
    __slots__ = ("session_id", "committed_length", "steering", "prefill_ms", "replica", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_length: int
    steering: _common_pb2.Tensor
    prefill_ms: float
    replica: str
    model: _common_pb2.ModelIdentity
    def __init__(self, session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., steering: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., replica: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelIdentity, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("ready", "result", "error")
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ready: VerifyReady
    result: _common_pb2.VerifyResult
    error: _common_pb2.StreamError
    def __init__(self, ready: _Optional[_Union[VerifyReady, _Mapping]] = ..., result: _Optional[_Union[_common_pb2.VerifyResult, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StreamError, _Mapping]] = ...) -> None: ...

class GetVerifierStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVerifierStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _common_pb2.ServiceStats
    def __init__(self, stats: _Optional[_Union[_common_pb2.ServiceStats, _Mapping]] = ...) -> None: ...
