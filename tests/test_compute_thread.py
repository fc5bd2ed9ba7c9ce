"""A stage runs all of its torch work on one thread: loading, the probe, every step (compute.py).

Each thread that enters an OpenMP parallel region keeps a team of its own, and once a process's
teams outnumber the cores libgomp lets idle threads spin only briefly: a lone stream's step then
took 39-42 ms instead of 27 (compute.py). Here a real stage worker, in this process and serving
over real gRPC on 127.0.0.1, records the thread of each piece of its torch work.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from layerline.protos.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.shared.sampling import SamplingParams
from layerline.stage_worker.codec import CodecLimits, Reassembler, WireTensor, whole_chunk
from layerline.stage_worker.compute import ComputeThread, StageCompute
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.frames import ReceivedStep
from layerline.stage_worker.server import StageWorker
from layerline.stage_worker.settings import StageSettings
from layerline.stage_worker.step_telemetry import StepClock

from .stage_client import StepStream, free_port, seq_input
from .test_engine import engine
from .tiny_models import make_tiny_checkpoint


def test_loading_the_probe_and_steps_small_and_large_run_on_one_thread(tmp_path, monkeypatch):
    make_tiny_checkpoint("smollm2", tmp_path)
    threads: dict[str, set[int]] = {"load": set(), "probe": set(), "step": set()}
    real_load, real_probe, real_run = StageWorker.load, StageEngine.probe, StageEngine.run

    def recorded(kind, real):
        def call(self, *args, **kwargs):
            threads[kind].add(threading.get_ident())
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(StageWorker, "load", recorded("load", real_load))
    monkeypatch.setattr(StageEngine, "probe", recorded("probe", real_probe))
    monkeypatch.setattr(StageEngine, "run", recorded("step", real_run))
    port = free_port()
    layers = f"0:{ModelConfig.from_checkpoint(tmp_path).num_layers}"  # the whole model: it answers the tokens
    worker = StageWorker(StageSettings(model=str(tmp_path), layers=layers, port=port, threads=1))

    def client() -> None:  # a real gRPC client, on a thread of its own
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = stage_pb2_grpc.StageWorkerStub(channel)
            model_id = ""
            for _ in range(300):  # until loaded: UNAVAILABLE meanwhile
                try:
                    model_id = stub.Info(stage_pb2.InfoRequest(probe=True), timeout=10).worker.model_id
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    threading.Event().wait(0.1)
            assert model_id
            stream = StepStream(channel)
            try:
                prompt = [1, 17, 42, 99, 3, 5, 8, 13, 21, 34]
                for seqs in (
                    [seq_input("a", range(len(prompt)), prompt)],  # a prompt: 10 tokens
                    [seq_input("a", [len(prompt)], [7])],  # one token, alone on the stage
                    [seq_input("a", [len(prompt) + 1], [8])],
                ):
                    header = stage_pb2.StepHeader(step_id=0, sequences=seqs, model_id=model_id)
                    stream.send([stage_pb2.StepFrame(header=header)])
                    result = stream.receive()
                    assert not result.error.code and not result.sequences[0].error.code, result
                    assert result.sequences[0].HasField("sampled_token_id")
            finally:
                stream.close()
        finally:
            channel.close()

    async def main() -> None:
        stop = asyncio.Event()
        served = asyncio.create_task(worker.serve(stop=stop))
        try:
            await asyncio.wait_for(asyncio.to_thread(client), timeout=120)
        finally:
            stop.set()
            await served

    asyncio.run(main())
    assert len(threads["step"]) == 1 and threads["step"] == threads["load"] == threads["probe"], threads
    assert threading.get_ident() not in threads["step"]  # never the event loop's thread


def test_the_compute_thread_runs_tasks_in_order_and_hands_back_results_and_errors():
    """ComputeThread: `run` (the event loop's) and `submit` (an Executor's) share one thread and
    one order; a task's error comes back in its future; a task cancelled before it began is skipped."""
    ran: list[str] = []
    pool = ComputeThread()
    gate = threading.Event()

    async def main() -> tuple[object, ...]:
        blocked = pool.run(gate.wait)  # holds the thread until the tasks below are queued
        first = pool.run(lambda: ran.append("first") or threading.current_thread().name)
        skipped = pool.run(lambda: ran.append("cancelled"))
        skipped.cancel()
        failing = pool.run(lambda: 1 // 0)
        last = pool.submit(ran.append, "last")
        gate.set()
        await blocked
        name = await first
        with pytest.raises(ZeroDivisionError):
            await failing
        await asyncio.wrap_future(last)
        return name, skipped.cancelled()

    name, cancelled = asyncio.run(main())
    assert (name, cancelled, ran) == ("stage-compute", True, ["first", "last"])
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 // 0).result(timeout=10)
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, "after")


def test_a_compute_thread_shut_down_without_waiting_still_runs_what_was_submitted():
    pool, gate, ran = ComputeThread(), threading.Event(), []
    pool.submit(gate.wait)
    queued = pool.submit(ran.append, "queued")
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, "after")
    gate.set()
    queued.result(timeout=10)
    pool.shutdown(wait=True)
    assert ran == ["queued"]


def test_a_stages_hidden_states_cross_as_bytes_made_and_read_on_the_compute_thread(tmp_path, monkeypatch):
    """A first stage's output goes as the bytes its compute thread made (`ReceivedStep.sent`, those
    `codec.encode` makes of the tensor; none past `sends_whole`), and a later stage makes the
    tensor of the bytes it received on its compute thread, never the event loop's: the same token
    as from the tensor itself."""
    make_tiny_checkpoint("smollm2", tmp_path)
    made_on: list[int] = []
    tensor_of = WireTensor.tensor

    def recorded(wire: WireTensor) -> torch.Tensor:
        made_on.append(threading.get_ident())
        return tensor_of(wire)

    monkeypatch.setattr(WireTensor, "tensor", recorded)
    prompt, greedy = (1, 17, 42, 99, 3), SamplingParams(temperature=0.0)
    first, later = SequenceStep("a", tuple(range(5)), prompt), SequenceStep("a", tuple(range(5)), sampling=greedy)

    def step(*seqs: SequenceStep, wire: WireTensor | None = None) -> ReceivedStep:
        return ReceivedStep(stage_pb2.StepHeader(step_id=1, alone=True), list(seqs), times=StepClock(), wire=wire)

    async def main() -> tuple[int, WireTensor | None, torch.Tensor, int]:
        sent = step(first)
        out = await StageCompute(engine(tmp_path, LayerRange(0, 2)), run_ahead=False).start(sent)
        too_large = step(first)
        await StageCompute(engine(tmp_path, LayerRange(0, 2)), run_ahead=False, sends_whole=8).start(too_large)
        assert sent.sent is not None and out.hidden is not None
        frame = tensor_pb2.TensorChunk()
        assert whole_chunk(sent.sent, frame, 1 << 20)
        received = step(later, wire=Reassembler(limits=CodecLimits()).add_wire(frame))
        drawn = await StageCompute(engine(tmp_path, LayerRange(2, 4)), run_ahead=False).start(received)
        return threading.get_ident(), too_large.sent, out.hidden, drawn.draws["a"].token_id

    loop, too_large, hidden, token = asyncio.run(main())
    assert too_large is None
    assert len(made_on) == 1 and made_on[0] != loop
    direct = engine(tmp_path, LayerRange(2, 4)).run([later], hidden)
    assert token == direct.draws["a"].token_id


if __name__ == "__main__":
    pytest.main([__file__])
