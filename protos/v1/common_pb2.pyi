from layerline.protos.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_NOT_SERVING: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_NOT_SERVING: WorkerState

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "logprobs", "speculate")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    speculate: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., speculate: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("address", "host", "pid", "instance_id", "model_id", "model_name", "layer_start", "layer_end", "num_layers", "dtype", "device", "tp_size", "kv_blocks_total", "kv_blocks_free", "kv_block_size", "in_flight_steps", "active_sequences", "state", "weights_bytes", "steps_computed", "compute_seconds", "orphan_ttl_seconds", "steps_run_ahead", "steps_run_ahead_dropped")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STEPS_RUN_AHEAD_DROPPED_FIELD_NUMBER: _ClassVar[int]
    address: str
    host: str
    pid: int
    instance_id: str
    model_id: str
    model_name: str
    layer_start: int
    layer_end: int
    num_layers: int
    dtype: _tensor_pb2.DType
    device: str
    tp_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    in_flight_steps: int
    active_sequences: int
    state: WorkerState
    weights_bytes: int
    steps_computed: int
    compute_seconds: float
    orphan_ttl_seconds: float
    steps_run_ahead: int
    steps_run_ahead_dropped: int
    def __init__(self, address: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., instance_id: _Optional[str] = ..., model_id: _Optional[str] = ..., model_name: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., device: _Optional[str] = ..., tp_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., in_flight_steps: _Optional[int] = ..., active_sequences: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., weights_bytes: _Optional[int] = ..., steps_computed: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., orphan_ttl_seconds: _Optional[float] = ..., steps_run_ahead: _Optional[int] = ..., steps_run_ahead_dropped: _Optional[int] = ...) -> None: ...
