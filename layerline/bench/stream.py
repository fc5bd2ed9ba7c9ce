"""What `layerline bench` keeps of one measured stream, however it was sent (gRPC SDK or HTTP)."""

from __future__ import annotations

from dataclasses import dataclass


class Seconds(float):
    """A measured time (shown in ms in the round logs)."""


@dataclass(frozen=True)
class Stream:
    ttft_s: float  # time to first token
    decode_tokens_per_s: float  # tokens after the first, per second after the first arrived
    median_gap_ms: float  # the median time between two tokens: robust to a machine's hiccups
    # Of a cluster's mean time between two tokens: the compute of its stages (as each stage counts
    # it, summed over the chain), and the rest (scheduling, messages between processes).
    compute_ms: float = 0.0
    other_ms: float = 0.0
