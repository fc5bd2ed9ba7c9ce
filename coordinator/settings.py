"""The coordinator's settings: one frozen dataclass, the command line's defaults included.

Owns `CoordinatorSettings` (each field with what it means) and the checks a value must pass
before the process starts. Imports only the standard library and light shared modules, so the
command line reads its defaults from here without loading the coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from layerline.model_store import DEFAULT_MODEL
from layerline.shared.sampling import MAX_SPECULATE
from layerline.shared.settings import DEFAULT_MAX_MESSAGE_BYTES, TelemetrySettings, TLSSettings

DEFAULT_PREFIX_CACHE = 0.25  # share of a chain's KV memory that finished sequences may keep as lenders
DEFAULT_MAX_PROMPT_BYTES = 1 << 20  # about 2 s of tokenizing on one core
DEFAULT_MAX_CHAT_MESSAGES = 256


@dataclass(frozen=True)
class CoordinatorSettings:
    model: str = DEFAULT_MODEL  # checkpoint dir or known name: tokenizer, chat template, layer count
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 7070  # port to listen on; 0 picks a free one
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # gRPC message limit
    default_max_tokens: int = 256  # when a request does not say
    max_active: int = 256  # sequences generating at once
    max_queued: int = 512  # requests waiting for a slot before RESOURCE_EXHAUSTED
    rate_limit: float = 1000.0  # new requests admitted per second
    token_budget: int = 512  # tokens per micro-batch step; longer prompts are prefilled in chunks
    share_prefixes: bool = True  # a new sequence copies the KV of a prefix a live one already computed
    prefix_cache: float = DEFAULT_PREFIX_CACHE  # share of a chain's KV that finished sequences may keep
    routing: str = "cache"  # new sequences go to the chain holding their prefix ("cache") or the least loaded ("load")
    depth: int | None = None  # micro-batches in flight per chain; default: the chain's length
    speculate: int = 0  # tokens drafted by prompt lookup that each decode step verifies at most; 0: off
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # UTF-8 bytes of a prompt, a chat's contents or rendering
    max_prompt_tokens: int | None = None  # a prompt's tokens at most; default: the model's context length
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES  # messages of one chat at most
    heartbeat_interval: float = 1.0  # seconds between a worker's heartbeats
    heartbeat_expiry: float = 5.0  # a worker unheard of this long leaves routing
    probe_interval: float = 15.0  # seconds between readiness probes (a real forward) of a worker
    grace_seconds: float = 30.0  # how long SIGTERM waits for in-flight requests
    cluster_port: int = 7071  # the Registry's port, where stage workers register; 0 picks a free one
    tls: TLSSettings = field(default_factory=TLSSettings)  # mutual TLS with members; the client port serves TLS too
    api_tokens: str | None = None  # a file of bearer tokens (one per line) clients must send; None: open
    admin_tokens: str | None = None  # a file of tokens that may also call ClusterStatus
    max_concurrent_rpcs: int = 1024  # calls served at once on each port; past it gRPC refuses new ones
    health_port: int = 0  # a plaintext port serving only grpc.health.v1 (for probes that speak no TLS); 0: none
    http_port: int | None = None  # the OpenAI-compatible HTTP API's port; None: off (0 picks a free one)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)  # traces, metrics; off by default

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_cache < 1.0:
            raise ValueError(f"--prefix-cache {self.prefix_cache} must be a fraction from 0 up to (not including) 1")
        for name in ("default_max_tokens", "max_active", "token_budget", "max_prompt_bytes", "max_chat_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.max_queued < 0:
            raise ValueError(f"--max-queued {self.max_queued} must be >= 0")
        if self.rate_limit <= 0:
            raise ValueError(f"--rate-limit {self.rate_limit} must be > 0 (requests per second)")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"--max-concurrent-rpcs {self.max_concurrent_rpcs} must be at least 1")
        self._check_ports()
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(
                f"--max-prompt-tokens {self.max_prompt_tokens} must be at least 1 (or left out: the context length)"
            )
        if not 0 <= self.speculate <= MAX_SPECULATE:
            raise ValueError(f"--speculate {self.speculate} must be in [0, {MAX_SPECULATE}] (0: off)")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"--depth {self.depth} must be at least 1 (or left out: the chain's length)")
        if not 0.0 < self.probe_interval < math.inf:  # NaN fails too
            raise ValueError(f"--probe-interval {self.probe_interval} must be a finite number of seconds above 0")

    def _check_ports(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port {self.http_port} must be in [0, 65535]")
        if self.http_port and self.http_port in (self.port, self.cluster_port):
            raise ValueError(f"--http-port {self.http_port} must differ from --port and --cluster-port")
        if self.cluster_port and self.cluster_port == self.port:
            raise ValueError(f"--cluster-port {self.cluster_port} must differ from --port: the Registry has its own")
