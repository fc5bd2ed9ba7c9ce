"""What the client SDK takes and hands back: the options of a request, and plain frozen dataclasses.

Owns the shapes users program against: `RequestOptions`, the keywords every generating call
takes, and one dataclass per kind of answer (`Completion`, `Chunk`, `ClusterStatus`, ...).
Knows nothing of gRPC or of the generated protobuf classes: `layerline.client.wire` checks the
options, builds the requests and fills these in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

FinishReason = Literal["stop", "length"]  # "stop": end-of-sequence or a stop string


class RequestOptions(TypedDict, total=False):
    """The keyword options of `generate`, `stream`, `chat` and `chat_stream`, in both clients.

    A sampling option left out (or None) is not sent, so the server's default applies; a bad
    value raises ValueError naming it before any call is made, an unknown keyword TypeError.
    """

    max_tokens: int | None  # tokens to generate at most, >= 1
    temperature: float | None  # >= 0; 0 is greedy (the server's default is 1.0)
    top_p: float | None  # in (0, 1]: sample from the smallest set of tokens whose probability reaches p
    top_k: int | None  # >= 0: sample from the k most likely tokens; 0 keeps all
    min_p: float | None  # in [0, 1]: drop tokens below min_p times the most likely one's probability
    repetition_penalty: float | None  # > 0; above 1 discourages tokens already in the sequence
    seed: int | None  # in [0, 2**64): makes a non-greedy draw reproducible, also after a failover
    stop: str | Sequence[str] | None  # end the answer before any of these (non-empty) strings
    logprobs: int | None  # >= 0: each token's logprob, and the n most likely alternatives
    speculate: int | None  # >= 0: tokens drafted by prompt lookup per step at most; 0 off; the server's if left out
    model: str | None  # the model's name or id; None: the one model the server serves
    timeout: float  # seconds the whole call may take, retries included, > 0; 600 (`wire.GENERATE_TIMEOUT`) if left out
    retries: int  # >= 0: times the call is made again while no token has arrived; the client's `retries` if left out


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
    steps_run_ahead: int = 0  # steps a first stage computed ahead as guesses that the next step took
    steps_run_ahead_dropped: int = 0  # and those it dropped, a different step coming instead


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
    preemptions: int = 0  # sequences whose KV was freed for an older one's and recomputed later
    stalls: int = 0  # chains that stopped answering steps within their bound; their sequences moved
    prefix_cache_queries: int = 0  # tokens of started sequences looked up in the KV; shared_prefix_tokens were found
    spec_decode_draft_tokens: int = 0  # tokens drafted by prompt lookup and verified (speculative decoding)
    spec_decode_accepted_tokens: int = 0  # of those, the ones accepted
