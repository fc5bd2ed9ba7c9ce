"""What the client SDK hands back: plain frozen dataclasses, one per kind of answer.

Owns the shapes users program against (`Completion`, `Chunk`, `ClusterStatus`, ...). Knows
nothing of gRPC or of the generated protobuf classes: `layerline.client.wire` fills these in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]  # "stop": end-of-sequence or a stop string


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # tokens of the prompt (or the rendered conversation)
    completion_tokens: int  # tokens generated


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the generated token (log-softmax of the raw logits)
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely tokens, most likely first


@dataclass(frozen=True)
class Completion:
    text: str  # the whole answer
    token_ids: list[int]  # every generated token, in order
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprobs] | None  # one per token; None when logprobs were not asked for


@dataclass(frozen=True)
class Chunk:
    text: str  # text decoded since the previous chunk
    token_ids: list[int]  # tokens generated since the previous chunk
    finish_reason: FinishReason | None  # set on the last chunk only
    usage: Usage | None  # set on the last chunk only
    logprobs: list[TokenLogprobs] | None  # one per entry of token_ids; None when not asked for


@dataclass(frozen=True)
class ModelInfo:
    model_id: str  # digest of the config and the weights' metadata
    model_name: str  # human-readable, e.g. "smollm2-135m-instruct"
    num_layers: int
    ready_replicas: int  # complete chains that can serve it now


@dataclass(frozen=True)
class WorkerLoad:
    in_flight_steps: int  # steps received and not yet answered
    active_sequences: int  # sequences holding KV on the worker
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_cached: int = 0  # held for the chain's cache of finished sequences (the coordinator's count)
    steps_computed: int = 0  # steps its layers ran since it started (as of its last heartbeat)
    compute_seconds: float = 0.0  # their compute time in total (not receiving or sending them)


@dataclass(frozen=True)
class WorkerStatus:
    address: str  # host:port of its StageWorker service
    host: str
    pid: int
    instance_id: str  # changes when the process restarts (and its KV cache is gone)
    model_id: str
    model_name: str
    layers: tuple[int, int]  # [start, end): the half-open range of layers it serves
    num_layers: int  # layers of the whole model
    replica: int | None  # the chain it serves in; None when in none
    tp: int  # tensor-parallel ranks of the stage
    state: str  # "STARTING", "SERVING", "DRAINING", "NOT_SERVING" or "UNSPECIFIED"
    dtype: str  # torch's name: "float32", "bfloat16", ...
    device: str  # of rank 0: "cpu", "cuda:0", ...
    load: WorkerLoad
    seconds_since_heartbeat: float
    weights_bytes: int = 0  # memory of the weights one rank of it holds


@dataclass(frozen=True)
class ChainStatus:
    replica: int
    model_id: str
    addresses: list[str]  # its stages, first layer first
    active_sequences: int
    cached_prefixes: int = 0  # finished sequences whose KV stays on the chain for later prompts
    cached_prefix_tokens: int = 0  # KV positions they hold on each stage


@dataclass(frozen=True)
class ClusterStatus:
    workers: list[WorkerStatus]
    chains: list[ChainStatus]
    active_requests: int  # requests generating now
    queued_requests: int  # requests admitted and waiting for a slot
    failovers: int = 0  # sequences moved off a chain that lost a worker, since the coordinator started
    last_failover_gap_seconds: float = 0.0  # from a failure to the moved sequence's next token
    max_failover_gap_seconds: float = 0.0
    shared_prefix_tokens: int = 0  # prompt tokens copied from a live or cached sequence's KV, not computed
