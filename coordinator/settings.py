"""The coordinator's settings: one frozen dataclass, the command line's defaults included.

Owns `CoordinatorSettings` (each field with what it means) and the checks a value must pass
before the process starts. Imports only the standard library and light shared modules, so the
command line reads its defaults from here without loading the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerline.model_store import DEFAULT_MODEL
from layerline.shared.settings import DEFAULT_MAX_MESSAGE_BYTES, TelemetrySettings

DEFAULT_PREFIX_CACHE = 0.25  # share of a chain's KV memory that finished sequences may keep as lenders


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
    depth: int | None = None  # micro-batches in flight per chain; default: the chain's length
    heartbeat_interval: float = 1.0  # seconds between a worker's heartbeats
    heartbeat_expiry: float = 5.0  # a worker unheard of this long leaves routing
    probe_interval: float = 15.0  # seconds between readiness probes (a real forward) of a worker
    grace_seconds: float = 30.0  # how long SIGTERM waits for in-flight requests
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)  # traces, metrics; off by default

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_cache < 1.0:
            raise ValueError(f"--prefix-cache {self.prefix_cache} must be a fraction from 0 up to (not including) 1")
        for name in ("default_max_tokens", "max_active", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.max_queued < 0:
            raise ValueError(f"--max-queued {self.max_queued} must be >= 0")
        if self.rate_limit <= 0:
            raise ValueError(f"--rate-limit {self.rate_limit} must be > 0 (requests per second)")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"--depth {self.depth} must be at least 1 (or left out: the chain's length)")
