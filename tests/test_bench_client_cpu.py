"""The bench's count of its own client's CPU a token, and the floor it sets under HTTP against gRPC."""

from __future__ import annotations

import pytest

from layerline.bench import client_cpu
from layerline.bench.client_cpu import ClientCpu, http_floor


class Clocks:
    """process_time and perf_counter that a fake run moves by set amounts."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 100.0

    def spend(self, cpu: float, wall: float) -> None:
        self.cpu += cpu
        self.wall += wall


def test_each_run_counts_its_cpu_over_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    clocks = Clocks()
    monkeypatch.setattr(client_cpu.time, "process_time", lambda: clocks.cpu)
    monkeypatch.setattr(client_cpu.time, "perf_counter", lambda: clocks.wall)
    cpu = ClientCpu()

    def run(cpu_s: float, wall_s: float, rate: float):
        def measure() -> float:
            clocks.spend(cpu_s, wall_s)
            return rate

        return measure

    grpc = cpu.measured("grpc", run(0.2, 4.0, 250.0))  # 1000 tokens, 0.2 ms each
    http = cpu.measured("http", run(0.9, 4.0, 225.0))  # 900 tokens, 1 ms each
    assert [grpc(), http(), grpc()] == [250.0, 225.0, 250.0]
    assert cpu.ms_per_token == {"grpc": [pytest.approx(0.2), pytest.approx(0.2)], "http": [pytest.approx(1.0)]}
    assert cpu.medians() == {"grpc": pytest.approx(0.2), "http": pytest.approx(1.0)}


def test_the_floor_charges_the_extra_cpu_one_for_one() -> None:
    # 0.8 ms more a token at 250 tokens/s: a token's 4 ms become 4.8 ms.
    assert http_floor(0.2, 1.0, 250.0) == pytest.approx(4.0 / 4.8)
    assert http_floor(0.3, 0.3, 250.0) == 1.0
    assert http_floor(0.5, 0.3, 250.0) == 1.0  # a client cheaper than the SDK sets no floor
