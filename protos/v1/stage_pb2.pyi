from layerline.protos.v1 import common_pb2 as _common_pb2
from layerline.protos.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepFrame(_message.Message):
    __slots__ = ("header", "hidden_chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: StepHeader
    hidden_chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[StepHeader, _Mapping]] = ..., hidden_chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class StepHeader(_message.Message):
    __slots__ = ("step_id", "model_id", "sequences", "route", "release_sequence_ids", "hidden", "reply", "alone", "chain", "route_tag", "run_ahead")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    ROUTE_TAG_FIELD_NUMBER: _ClassVar[int]
    RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    model_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInput]
    route: _containers.RepeatedScalarFieldContainer[str]
    release_sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    hidden: _tensor_pb2.TensorChunk
    reply: DirectReply
    alone: bool
    chain: _containers.RepeatedScalarFieldContainer[str]
    route_tag: bytes
    run_ahead: bool
    def __init__(self, step_id: _Optional[int] = ..., model_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceInput, _Mapping]]] = ..., route: _Optional[_Iterable[str]] = ..., release_sequence_ids: _Optional[_Iterable[str]] = ..., hidden: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., reply: _Optional[_Union[DirectReply, _Mapping]] = ..., alone: _Optional[bool] = ..., chain: _Optional[_Iterable[str]] = ..., route_tag: _Optional[bytes] = ..., run_ahead: _Optional[bool] = ...) -> None: ...

class DirectReply(_message.Message):
    __slots__ = ("subscriber", "step_id")
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    step_id: int
    def __init__(self, subscriber: _Optional[str] = ..., step_id: _Optional[int] = ...) -> None: ...

class SequenceInput(_message.Message):
    __slots__ = ("sequence_id", "positions", "token_ids", "sample", "sampling", "history_token_ids", "trace_context", "prefix_from", "draft", "rewind")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FROM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: _common_pb2.SamplingParams
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    prefix_from: str
    draft: int
    rewind: bool
    def __init__(self, sequence_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., prefix_from: _Optional[str] = ..., draft: _Optional[int] = ..., rewind: _Optional[bool] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sequences", "error", "failed_address", "replied")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLIED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    error: _common_pb2.Status
    failed_address: str
    replied: bool
    def __init__(self, step_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., failed_address: _Optional[str] = ..., replied: _Optional[bool] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("sequence_id", "sampled_token_id", "logprob", "top_logprobs", "error", "accepted")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    sampled_token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    error: _common_pb2.Status
    accepted: _containers.RepeatedCompositeFieldContainer[AcceptedToken]
    def __init__(self, sequence_id: _Optional[str] = ..., sampled_token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., accepted: _Optional[_Iterable[_Union[AcceptedToken, _Mapping]]] = ...) -> None: ...

class AcceptedToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_ids",)
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "kv_blocks_free")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    released: int
    kv_blocks_free: int
    def __init__(self, released: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("probe",)
    PROBE_FIELD_NUMBER: _ClassVar[int]
    probe: bool
    def __init__(self, probe: _Optional[bool] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("worker", "probe_seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PROBE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    probe_seconds: float
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., probe_seconds: _Optional[float] = ...) -> None: ...
