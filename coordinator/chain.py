"""The coordinator's connection to one chain: a long-lived Step stream to its first stage.

Owns turning a `PlannedStep` into a StepHeader (positions, token ids, sampling, the rest of the
route, and when tracing each sequence's trace carrier: the context of its request's `step`
span), matching each StepResult to the step that asked, and the
Release calls that free a sequence's KV on every stage of the chain. When the stream breaks,
every step waiting on it fails with `StepFailed` naming the hop.

On a chain of several stages it also keeps a Results stream open to the last stage and asks for
each step's result there (StepHeader.reply): the way back up the chain would cost a message and a
wake-up per extra stage on every token. When that stream breaks, the steps that were to be
answered on it fail like those of a broken Step stream, and the next step opens a new one.

Knows nothing of text or of which requests the sequences serve.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Tracer

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from layerline.shared.errors import Code
from layerline.shared.routes import route_tag
from layerline.shared.rpc import aio_channel
from layerline.shared.wire import sampling_to_wire

from .stall import StallBound, StallPolicy
from .steps import Outcome, PlannedStep, StepFailed, Token
from .telemetry import StepSpans

log = logging.getLogger(__name__)

RELEASE_TIMEOUT = 5.0
PROBE_TIMEOUT = 10.0
WATCH_EVERY = 0.1  # seconds between looks at the oldest unanswered step


@dataclass(frozen=True)
class MemberLinks:
    """How the coordinator reaches and commands its stages."""

    route_key: bytes  # tags every route it issues (`layerline.shared.routes`); stages get it at Register
    credentials: grpc.ChannelCredentials | None = None  # mutual TLS as the coordinator; None: plaintext


class ChainClient:
    def __init__(
        self,
        addresses: list[str],
        *,
        model_id: str,
        max_message_bytes: int,
        links: MemberLinks,
        tracer: Tracer | None = None,
        stall: StallPolicy = StallPolicy(),
    ) -> None:
        self.addresses = addresses
        self.model_id = model_id
        self.tracer = tracer  # None: tracing is off, steps carry no trace context
        self._route_tag = route_tag(links.route_key, model_id, addresses)
        self._channels = {
            a: aio_channel(a, credentials=links.credentials, max_message_bytes=max_message_bytes) for a in addresses
        }
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: dict[int, asyncio.Future[stage_pb2.StepResult]] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._closed = False
        self._subscriber = uuid.uuid4().hex  # names this chain's Results stream on its last stage
        self._results: grpc.aio.UnaryStreamCall | None = None
        self._replies: set[int] = set()  # steps asked to answer on the current Results stream
        self.stall = StallBound(stall)
        self._sent: dict[int, tuple[float, int]] = {}  # unanswered step id -> (sent at, its tokens)
        self._last_answer = 0.0  # when the last step was answered (monotonic)
        self._watchdog: asyncio.Task[None] | None = None
        self.stalled_since: float | None = None  # when it stopped answering, once it counts as hung

    async def __call__(self, step: PlannedStep) -> list[Outcome]:
        header = stage_pb2.StepHeader(
            step_id=next(self._ids),
            model_id=self.model_id,
            route=self.addresses[1:],
            release_sequence_ids=step.release,
            alone=step.alone,
            run_ahead=step.run_ahead,
            chain=self.addresses,
            route_tag=self._route_tag,
        )
        for s in step.slices:
            seq = header.sequences.add(
                sequence_id=s.seq.kv_id,
                positions=range(s.start, s.start + len(s.token_ids) + len(s.draft)),
                token_ids=s.token_ids + s.draft,
                sample=s.sample,
                prefix_from=s.prefix_from.kv_id if s.prefix_from is not None else "",
                draft=len(s.draft),
                rewind=s.rewind,
            )
            if s.sample:
                sampling_to_wire(s.seq.sampling, seq.sampling)
                if s.seq.sampling.repetition_penalty != 1.0:
                    seq.history_token_ids.extend(s.seq.history)
        if self.tracer is None:
            return await self._exchange(header)
        spans = StepSpans(
            self.tracer, step, [seq.trace_context for seq in header.sequences], chain=" -> ".join(self.addresses)
        )
        try:
            outcomes = await self._exchange(header)
        except StepFailed as err:
            spans.failed(err)
            raise
        spans.done(outcomes)
        return outcomes

    async def _exchange(self, header: stage_pb2.StepHeader) -> list[Outcome]:
        """Send one step's header to the chain's first stage and wait for its result."""
        future: asyncio.Future[stage_pb2.StepResult] = asyncio.get_running_loop().create_future()
        tokens = sum(len(s.positions) for s in header.sequences)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        async with self._lock:
            self._pending[header.step_id] = future
            if len(self.addresses) > 1:
                self._ensure_results()
                header.reply.subscriber = self._subscriber
                header.reply.step_id = header.step_id
                self._replies.add(header.step_id)
            replies = self._replies
            try:
                self._sent[header.step_id] = (time.monotonic(), tokens)
                await self._stream().write(stage_pb2.StepFrame(header=header))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
                self._pending.pop(header.step_id, None)
                why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else str(err)
                raise StepFailed(  # one line: an AioRpcError's own text spans several (its debug string)
                    Code.UNAVAILABLE,
                    f"stage {self.addresses[0]} is unreachable: {why}",
                    failed_address=self.addresses[0],
                ) from None
        try:
            result = await future
        finally:
            replies.discard(header.step_id)  # answered, either way
            sent, _ = self._sent.pop(header.step_id, (0.0, 0))
        if result.error.code == Code.DEADLINE_EXCEEDED and not result.failed_address:  # stalled: no hop named
            raise StepFailed(Code.DEADLINE_EXCEEDED, result.error.message, since=self.stalled_since)
        if result.error.code:
            raise StepFailed(
                result.error.code, result.error.message, failed_address=result.failed_address or self.addresses[0]
            )
        now = time.monotonic()
        self.stall.observe(tokens, now - max(sent, self._last_answer))
        self._last_answer = now
        return [
            Outcome(
                sequence_id=r.sequence_id,
                token_id=r.sampled_token_id if r.HasField("sampled_token_id") else None,
                logprob=r.logprob if r.HasField("logprob") else None,
                top=_top(r.top_logprobs),
                error_code=Code.of(r.error.code),
                error_message=r.error.message,
                accepted=tuple(
                    Token(t.token_id, t.logprob if t.HasField("logprob") else None, _top(t.top_logprobs))
                    for t in r.accepted
                ),
            )
            for r in result.sequences
        ]

    def _stream(self) -> grpc.aio.StreamStreamCall:
        if self._call is None or self._call.done():
            stub = stage_pb2_grpc.StageWorkerStub(self._channels[self.addresses[0]])
            self._call = stub.Step()
            pending: dict[int, asyncio.Future[stage_pb2.StepResult]] = {}
            pending.update(self._pending)
            self._pending = pending
            asyncio.get_running_loop().create_task(self._read(self._call, pending))
        return self._call

    async def _read(
        self, call: grpc.aio.StreamStreamCall, pending: dict[int, asyncio.Future[stage_pb2.StepResult]]
    ) -> None:
        reason = f"stage {self.addresses[0]} closed the Step stream"
        try:
            async for result in call:
                if not result.replied:  # an acknowledgement; the first stage keeps these
                    _settle(pending.pop(result.step_id, None), result)
        except grpc.aio.AioRpcError as err:
            reason = f"stage {self.addresses[0]} failed: {err.code().name}: {err.details()}"
        if self._call is call:
            self._call = None
        failure = _unavailable(reason, self.addresses[0])
        for future in pending.values():
            _settle(future, failure)
        pending.clear()

    def _ensure_results(self) -> None:
        if self._results is None or self._results.done():
            stub = stage_pb2_grpc.StageWorkerStub(self._channels[self.addresses[-1]])
            self._results = stub.Results(stage_pb2.ResultsRequest(subscriber=self._subscriber))
            self._replies = set()
            asyncio.get_running_loop().create_task(self._read_results(self._results, self._replies))

    async def _read_results(self, call: grpc.aio.UnaryStreamCall, replies: set[int]) -> None:
        reason = f"stage {self.addresses[-1]} closed the Results stream"
        try:
            async for result in call:
                _settle(self._pending.pop(result.step_id, None), result)
        except grpc.aio.AioRpcError as err:
            reason = f"stage {self.addresses[-1]} failed: {err.code().name}: {err.details()}"
        failure = _unavailable(reason, self.addresses[-1])
        for step_id in replies:
            _settle(self._pending.pop(step_id, None), failure)
        replies.clear()

    async def release(self, sequence_ids: list[str]) -> None:
        """Free the sequences' KV on every stage of the chain; best effort, failures logged."""
        if not sequence_ids or self._closed:
            return
        request = stage_pb2.ReleaseRequest(sequence_ids=sequence_ids)
        calls = [
            stage_pb2_grpc.StageWorkerStub(ch).Release(request, timeout=RELEASE_TIMEOUT)
            for ch in self._channels.values()
        ]
        for address, outcome in zip(self._channels, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(outcome, grpc.aio.AioRpcError):
                log.warning("release of %s on %s failed: %s", sequence_ids, address, outcome.code().name)

    async def _watch(self) -> None:
        """Fail every unanswered step once the oldest has waited past the stall bound: the chain
        is hung (a stopped process, a stuck thread, a partitioned link), heartbeats or not."""
        while not self._closed:
            await asyncio.sleep(WATCH_EVERY)
            if not self._sent:
                continue
            oldest = min(self._sent)
            sent, tokens = self._sent[oldest]
            waited, allowed = time.monotonic() - max(sent, self._last_answer), self.stall.allowed(tokens)
            if waited <= allowed:
                continue
            reason = (
                f"chain {' -> '.join(self.addresses)} did not answer a step of {tokens} token(s) in "
                f"{waited:.1f}s (its bound: {allowed:.1f}s, from its recent step times)"
            )
            log.warning("%s; failing its %d unanswered step(s)", reason, len(self._pending))
            self.stalled_since = max(sent, self._last_answer)
            stalled = stage_pb2.StepResult(error=common_pb2.Status(code=Code.DEADLINE_EXCEEDED, message=reason))
            for future in list(self._pending.values()):
                _settle(future, stalled)
            self._pending.clear()
            self._sent.clear()

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for call in (self._call, self._results):
            if call is not None:
                call.cancel()
        for channel in self._channels.values():
            await channel.close(None)


def _top(logprobs: Iterable[common_pb2.TokenLogprob]) -> tuple[tuple[int, float], ...]:
    return tuple((t.token_id, t.logprob) for t in logprobs)


def _settle(future: asyncio.Future[stage_pb2.StepResult] | None, result: stage_pb2.StepResult) -> None:
    """Answer a waiting step, unless it is gone or already answered (by the other stream)."""
    if future is not None and not future.done():
        future.set_result(result)


def _unavailable(reason: str, address: str) -> stage_pb2.StepResult:
    return stage_pb2.StepResult(error=common_pb2.Status(code=Code.UNAVAILABLE, message=reason), failed_address=address)


class ProbeFailed(Exception):
    """A worker did not pass its readiness probe: it failed the call, or answered what it must not."""


async def probe(address: str, *, credentials: grpc.ChannelCredentials | None = None) -> float:
    """Ask a worker to run a real one-token forward; its wall time in seconds, or ProbeFailed.

    Only SERVING with a finite, non-negative time passes: an unknown state (a value this version
    does not define) or a nonsensical time fails the probe like an error would.
    """
    async with aio_channel(address, credentials=credentials) as channel:
        try:
            reply = await stage_pb2_grpc.StageWorkerStub(channel).Info(
                stage_pb2.InfoRequest(probe=True), timeout=PROBE_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            raise ProbeFailed(f"{err.code().name}: {err.details()}") from None
    state = reply.worker.state
    if state != common_pb2.WORKER_STATE_SERVING:
        known = state in common_pb2.WorkerState.values()
        raise ProbeFailed(f"it reports {common_pb2.WorkerState.Name(state) if known else f'an unknown state {state}'}")
    if not (math.isfinite(reply.probe_seconds) and reply.probe_seconds >= 0):
        raise ProbeFailed(f"it reports a probe time of {reply.probe_seconds} seconds")
    return reply.probe_seconds
