"""The CPU the bench's own client spends a token, and the floor it sets under HTTP against gRPC.

The bench's clients run in its process, on the two cores the stages compute on. The `openai`
client parses every chunk (httpx, a pydantic model a chunk) where the gRPC SDK decodes a
protobuf message, and that CPU is taken from the stages: their OpenMP threads wait for each other
at every barrier, so a client preempting one of them delays the whole step by about as long.
`ClientCpu` counts the process's CPU time (every thread: the SDK's gRPC threads too) over each
measured run of the concurrent figures, per token; `http_floor` turns the difference into the
most the HTTP figure could reach against gRPC's on this machine if each millisecond of the
client's extra CPU delays the stages by one (the budget is judged on the measured ratio; this
says what of its shortfall is the client's).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class ClientCpu:
    """The bench process's CPU milliseconds a token over each run it wraps, by figure."""

    def __init__(self) -> None:
        self.ms_per_token: dict[str, list[float]] = {}

    def measured(self, name: str, run: Callable[[], float]) -> Callable[[], float]:
        """`run` (which returns tokens/s), counting the process's CPU over its tokens: the rate times
        the run's wall time (its connecting included: milliseconds of a run of seconds)."""

        def timed() -> float:
            cpu, wall = time.process_time(), time.perf_counter()
            rate = run()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            self.ms_per_token.setdefault(name, []).append(1000 * cpu / max(rate * wall, 1e-9))
            return rate

        return timed

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(samples) for name, samples in self.ms_per_token.items()}


def http_floor(grpc_ms_per_token: float, http_ms_per_token: float, grpc_tokens_per_s: float) -> float:
    """The HTTP rate against gRPC's if the `openai` client's extra CPU a token delays the stages
    one for one: a token's time 1/rate grows by the extra, so the ratio is 1 / (1 + extra * rate)."""
    extra_s = max(http_ms_per_token - grpc_ms_per_token, 0.0) / 1000
    return 1 / (1 + extra_s * grpc_tokens_per_s)
