"""A stage worker's settings: one frozen dataclass, the command line's defaults included.

Owns `StageSettings` (each field with what it means) and the checks a value must pass before a
process starts, and `openmp_defaults`, the OpenMP environment a stage process starts torch in.
The command line reads its defaults from here and builds one; a tensor-parallel stage hands it
to its other ranks as JSON (`layerline.shared.settings.to_json`). Imports only the standard
library and `layerline.shared.settings`, so `layerline --help` stays light.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from layerline.shared.settings import DEFAULT_MAX_MESSAGE_BYTES, DTYPES, TelemetrySettings, TLSSettings

# float32 on CPU: linear weights both plain and packed for oneDNN, or one of them (stage_worker/layouts.py)
WEIGHT_LAYOUTS = ("both", "packed", "plain")
# linear layers and LM head: the checkpoint's dtype, or weight-only int8 / int4 (stage_worker/quantize.py)
QUANTIZE = ("none", "int8", "int4")


@dataclass(frozen=True)
class StageSettings:
    model: str  # checkpoint directory, or a known model name fetched on first use
    layers: str  # the half-open layer range "START:END"
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 0  # port to listen on; 0 picks a free one
    advertise: str | None = None  # address peers reach this stage at; default host:port
    coordinator: str | None = None  # coordinator address to register with
    dtype: str = "float32"  # weights and activations: one of DTYPES
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1 ...
    kv_memory_bytes: int = 256 << 20  # budget of the preallocated KV block pool
    kv_block_size: int = 16  # tokens per KV block
    weight_layout: str = "both"  # one of WEIGHT_LAYOUTS (see stage_worker/layouts.py)
    quantize: str = "none"  # one of QUANTIZE: the linear layers' and LM head's weights (stage_worker/quantize.py)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # gRPC message limit; larger tensors are chunked
    max_tensor_bytes: int = 1 << 30  # largest hidden-state tensor accepted in one step
    max_in_flight: int = 16  # steps per upstream stream received and not yet answered
    max_sequences: int = 1024  # sequences in one step
    max_step_tokens: int = 8192  # tokens in one step
    threads: int | None = None  # torch CPU threads; default: all cores
    prefill_threads: int | None = None  # threads for a step alone on its chain; default: `threads`
    grace_seconds: float = 5.0  # how long SIGTERM waits for in-flight calls
    tp: int = 1  # tensor-parallel ranks of this stage, on this node
    tp_timeout: float = 10.0  # a collective waiting longer than this fails the stage (seconds)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)  # traces, metrics; off by default
    tls: TLSSettings = field(default_factory=TLSSettings)  # mutual TLS with the cluster's members; off: plaintext
    max_concurrent_rpcs: int = 256  # calls served at once; past it gRPC refuses new ones
    health_port: int = 0  # a plaintext port serving only grpc.health.v1 (for probes that speak no TLS); 0: none
    orphan_ttl: float = 300.0  # free the KV of a sequence no step touched for this long (seconds); 0: never

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"--weight-layout {self.weight_layout!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE)}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"--max-concurrent-rpcs {self.max_concurrent_rpcs} must be at least 1")
        if not 0 <= self.orphan_ttl < math.inf:  # NaN fails too
            raise ValueError(f"--orphan-ttl {self.orphan_ttl} must be a finite number of seconds, 0 or more (0: never)")
        if self.tp < 1:
            raise ValueError(f"--tp {self.tp} must be at least 1")
        for name in ("threads", "prefill_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be at least 1 (or left out: all cores)")

    @property
    def max_chunk_bytes(self) -> int:
        # Leave room in each message for the frame's own fields.
        return max(1024, self.max_message_bytes - min(64 << 10, self.max_message_bytes // 2))


def openmp_defaults(environ: MutableMapping[str, str]) -> None:
    """The OpenMP wait policy a stage runs with, unless `environ` names one (either variable).

    A stage runs torch on one thread (stage_worker/compute.py), so its OpenMP team is the only
    one: between two of a step's parallel regions (a single row's step has about 150) its idle
    threads spin `GOMP_SPINCOUNT` times before they sleep. Too few and they sleep and are woken
    between regions; too many and after a step they keep a core that the chain's next stage (or
    the coordinator) needs. libgomp's default, 300000 spins, is about 3 ms by its own estimate,
    and longer where a spin is slow (Intel's pause instruction). Measured on 2 cores of an Intel
    Xeon (AVX-512, AMX), 2 rounds each, a lone stream on 1 and 2 stages: 3000 spins 25.6 and 23.9
    tok/s, 10000 31.5 and 28.8, 30000 32.4 and 28.3, 100000 31.4 and 26.3, 300000 32.5 and 25.7
    (32 streams: 30000 the fastest on both). 30000 is that machine's choice; on others it is a
    default, not a measurement. The active policy keeps a thread spinning 1000 times (not 100)
    should the process ever run more OpenMP threads than cores. libgomp reads both when it
    loads: set before torch is imported.
    """
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "ACTIVE"
        environ["GOMP_SPINCOUNT"] = "30000"


def check_weight_layout(weight_layout: str) -> None:
    """ValueError naming the choices unless `weight_layout` is one of WEIGHT_LAYOUTS."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout {weight_layout!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")


def check_quantize(quantize: str) -> None:
    """ValueError naming the choices unless `quantize` is one of QUANTIZE."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZE)}")
