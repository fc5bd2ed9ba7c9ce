"""A scripted Coordinator for the client SDK's tests: each prompt gets a fixed script (deltas, a
final message, an error in the middle of a stream, RESOURCE_EXHAUSTED with a retry hint, a call
slower than its deadline, a refusal for the first tries only), and every request and its
metadata are recorded, so that a test sees exactly what went on the wire, and how many times.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, tensor_pb2

pb = coordinator_pb2
STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH
STORY = [
    pb.GenerateResponse(text="Once", token_ids=[101]),
    pb.GenerateResponse(text=" there", token_ids=[102, 103]),
    pb.GenerateResponse(
        text=" was", token_ids=[104], finish_reason=STOP, usage=pb.Usage(prompt_tokens=4, completion_tokens=4)
    ),
]
WITH_LOGPROBS = [
    pb.GenerateResponse(
        text="Hi",
        token_ids=[7],
        logprobs=[pb.TokenLogprobs(logprob=-0.5, top_logprobs=[common_pb2.TokenLogprob(token_id=7, logprob=-0.5)])],
    ),
    pb.GenerateResponse(
        text="!",
        token_ids=[8],
        logprobs=[pb.TokenLogprobs(logprob=-1.25, top_logprobs=[common_pb2.TokenLogprob(token_id=9, logprob=-1.0)])],
        finish_reason=LENGTH,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
    ),
]
UNAVAILABLE_DETAILS = "chain 0 lost worker 127.0.0.1:7101; retries exhausted (3)"
BUSY_DETAILS = "queue full: 64 requests waiting (limit --max-queued 64)"
NO_CHAIN_DETAILS = "no complete chain of workers covers layers [0, 30) right now"


@dataclass
class Received:
    method: str
    request: pb.GenerateRequest | pb.ChatRequest
    metadata: dict[str, str]


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.cancelled = threading.Event()  # set when the client cancelled the "endless" stream
        self.tries: Counter[str] = Counter()  # calls per prompt (or last chat message)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self.received.append(Received("Generate", request, dict(context.invocation_metadata())))
        yield from self._answer(request.prompt, request.model, context)

    def Chat(self, request: pb.ChatRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self.received.append(Received("Chat", request, dict(context.invocation_metadata())))
        yield from self._answer(request.messages[-1].content, request.model, context)

    def _answer(self, key: str, model: str, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:  # noqa: PLR0912
        self.tries[key] += 1
        if model == "nope":
            context.abort(grpc.StatusCode.NOT_FOUND, "model 'nope' is not served")
        if key in ("Once upon a time", "Hi"):
            yield from STORY
        elif key == "logprobs":
            yield from WITH_LOGPROBS
        elif key == "fail midway":
            yield STORY[0]
            context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_DETAILS)
        elif key == "busy":
            context.set_trailing_metadata((("retry-after-ms", "1500"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_DETAILS)
        elif key == "busy twice" and self.tries[key] <= 2:
            context.set_trailing_metadata((("retry-after-ms", "400"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_DETAILS)
        elif key == "down" or (key == "unavailable once" and self.tries[key] == 1):
            context.abort(grpc.StatusCode.UNAVAILABLE, NO_CHAIN_DETAILS)
        elif key in ("busy twice", "unavailable once"):
            yield from STORY
        elif key == "busy, pushback only":
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "250"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_DETAILS)
        elif key == "slow":
            for _ in range(200):  # 10 s at most; the client's deadline ends it long before
                if not context.is_active():
                    return
                time.sleep(0.05)
            yield from STORY
        elif key == "endless":
            try:
                for i in range(500):  # 10 s unless the client cancels
                    if not context.is_active():
                        return
                    yield pb.GenerateResponse(text="x", token_ids=[i])
                    time.sleep(0.02)
            finally:  # grpc may close this generator at a yield once the call is cancelled
                if not context.is_active():
                    self.cancelled.set()
        elif key == "no finish":
            yield STORY[0]
        elif key == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: 9000 > limit 2048")
        elif key == "broken":
            context.abort(grpc.StatusCode.INTERNAL, "step failed")
        elif key == "denied":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        model = pb.ModelInfo(model_id="d1g", model_name="smollm2", num_layers=30, ready_replicas=2)
        return pb.ListModelsResponse(models=[model])

    def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClusterStatusResponse:
        serving = common_pb2.WorkerInfo(
            address="127.0.0.1:7101",
            host="node-a",
            pid=4242,
            instance_id="i-1",
            model_id="d1g",
            model_name="smollm2",
            layer_start=0,
            layer_end=15,
            num_layers=30,
            dtype=tensor_pb2.BFLOAT16,
            device="cpu",
            tp_size=2,
            kv_blocks_total=512,
            kv_blocks_free=500,
            kv_block_size=16,
            in_flight_steps=3,
            active_sequences=5,
            state=common_pb2.WORKER_STATE_SERVING,
        )
        draining = common_pb2.WorkerInfo(
            address="127.0.0.1:7102",
            host="node-b",
            pid=77,
            instance_id="i-2",
            model_id="d1g",
            model_name="smollm2",
            layer_start=15,
            layer_end=30,
            num_layers=30,
            dtype=tensor_pb2.FLOAT32,
            device="cpu",
            tp_size=1,
            kv_blocks_total=64,
            kv_blocks_free=64,
            state=common_pb2.WORKER_STATE_DRAINING,
        )
        return pb.ClusterStatusResponse(
            workers=[
                pb.ClusterWorker(worker=serving, replica=0, seconds_since_heartbeat=0.5),
                pb.ClusterWorker(worker=draining, seconds_since_heartbeat=2.0),
            ],
            chains=[
                pb.Chain(replica=0, model_id="d1g", addresses=["127.0.0.1:7101", "127.0.0.1:7103"], active_sequences=5)
            ],
            active_requests=5,
            queued_requests=1,
        )
