"""Test-side helpers: start stage worker processes and talk to them over a raw Step stream."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from layerline.shared import ports
from layerline.stage_worker import codec


def free_port() -> int:
    """A free port on 127.0.0.1, outside the range outgoing connections take theirs from."""
    return ports.free_port("127.0.0.1")


def free_ports(n: int) -> int:
    """The first of n consecutive free ports on 127.0.0.1."""
    return ports.free_port("127.0.0.1", count=n)


class StageProcess:
    """`layerline stage ...` as a real OS process on a free 127.0.0.1 port."""

    def __init__(self, model: Path | str, layers: str, *extra: str, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"stage-{layers.replace(':', '-')}-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "layerline",
                "stage",
                "--model",
                str(model),
                "--layers",
                layers,
                "--port",
                str(self.port),
                "--threads",
                "1",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.channel = grpc.insecure_channel(self.address)

    def wait_serving(self, timeout: float = 120.0) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stage exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"stage {self.address} not SERVING after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def info(self) -> common_pb2.WorkerInfo:
        return stage_pb2_grpc.StageWorkerStub(self.channel).Info(stage_pb2.InfoRequest(), timeout=10).worker

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.channel.close()
        self._log.close()
        return self.proc.returncode


def seq_input(
    sid: str, positions: Sequence[int], token_ids: Sequence[int] = (), *, sample: bool = True, **sampling
) -> stage_pb2.SequenceInput:
    params = common_pb2.SamplingParams(temperature=0.0, **sampling)
    return stage_pb2.SequenceInput(
        sequence_id=sid, positions=list(positions), token_ids=list(token_ids), sample=sample, sampling=params
    )


class StepStream:
    """One long-lived Step stream; `step` sends a step's frames and waits for its result."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._frames: queue.Queue[stage_pb2.StepFrame | None] = queue.Queue()
        self._results = stage_pb2_grpc.StageWorkerStub(channel).Step(iter(self._frames.get, None))
        self._next_id = 1

    def send(self, frames: Iterable[stage_pb2.StepFrame]) -> None:
        for frame in frames:
            self._frames.put(frame)

    def receive(self) -> stage_pb2.StepResult:
        return next(self._results)

    def step(
        self,
        seqs: Sequence[stage_pb2.SequenceInput],
        *,
        route: Sequence[str] = (),
        hidden: torch.Tensor | None = None,
        chunk_bytes: int = 1 << 20,
        release: Sequence[str] = (),
    ) -> stage_pb2.StepResult:
        step_id = self._next_id
        self._next_id += 1
        header = stage_pb2.StepHeader(
            step_id=step_id, sequences=list(seqs), route=list(route), release_sequence_ids=list(release)
        )
        frames = [stage_pb2.StepFrame(header=header)]
        if hidden is not None:
            frames += [stage_pb2.StepFrame(hidden_chunk=c) for c in codec.chunk(hidden, chunk_bytes)]
        self.send(frames)
        result = self.receive()
        assert result.step_id == step_id
        return result

    def close(self) -> None:
        self._frames.put(None)
