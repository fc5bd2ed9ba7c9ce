"""Where a computed step goes: down its route to the next hop, or back as results from the last stage.

Owns
- forwarding: the header the next hop gets (the route past this stage, the sequences that ran
  here, `reply` only when no sequence was dropped, the releases and `alone` passed on), with the
  hidden states in the header when both fit in one message, else as `hidden_chunk` frames after
  it, written through the stage's `NextHops`;
- merging: the answer that comes back up, with this stage's own per-sequence errors put back in
  the step's order (a sequence dropped here is answered with its error, the rest as downstream
  answered them);
- the last stage's answer: the sampled tokens go on the coordinator's Results stream the header
  names, when that subscriber is open and not too far behind, with only an acknowledgement up
  the chain (with the tokens drawn, and ahead of the result, when the header says `run_ahead` and
  the chain has more stages: the first stage starts the next step with them, `on_drawn`); else
  the whole result goes up the chain;
- `Subscribers`: the open Results streams, by subscriber name.

Knows nothing of how frames became steps, of where a step computes, or of gRPC status codes
beyond the shared error table (`layerline.shared.wire.status_message`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from layerline.protos.v1 import common_pb2, stage_pb2
from layerline.shared.errors import Unreachable
from layerline.shared.wire import status_message

from .codec import WireTensor, chunk, whole_chunk
from .engine import SequenceError, StepOutput
from .frames import ReceivedStep
from .hops import NextHops

FRAME_OVERHEAD_BYTES = 32  # field tags and lengths around a header and its hidden chunk
MAX_UNSENT_RESULTS = 256  # direct results waiting on one Results stream; beyond, they go up the chain

Answer = Callable[[stage_pb2.StepResult], None]
Drawn = Callable[[ReceivedStep, StepOutput, dict[str, int]], None]


class Subscribers:
    """The open Results streams, each a queue of the results still to send on it."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[stage_pb2.StepResult]] = {}

    def open(self, name: str) -> asyncio.Queue[stage_pb2.StepResult]:
        """A stream for `name`; a reconnecting subscriber replaces its old stream."""
        queue: asyncio.Queue[stage_pb2.StepResult] = asyncio.Queue()
        self._queues[name] = queue
        return queue

    def close(self, name: str, queue: asyncio.Queue[stage_pb2.StepResult]) -> None:
        if self._queues.get(name) is queue:
            del self._queues[name]

    def takes(self, reply: stage_pb2.DirectReply) -> bool:
        """Whether the subscriber a header names is open and not too far behind."""
        queue = self._queues.get(reply.subscriber)
        return queue is not None and queue.qsize() < MAX_UNSENT_RESULTS

    def reply(self, reply: stage_pb2.DirectReply, result: stage_pb2.StepResult) -> None:
        """Queue a step's result for the subscriber its header names (which `takes` it; a stream
        closed since loses it, as the results still queued on it when it closed)."""
        result.step_id = reply.step_id
        queue = self._queues.get(reply.subscriber)
        if queue is not None:
            queue.put_nowait(result)


class Delivery:
    """Sends computed steps on, and turns what comes back into the answer up the chain."""

    def __init__(
        self,
        hops: NextHops,
        *,
        is_last: bool,
        is_first: bool,
        hidden_size: int,
        max_message_bytes: int,
        max_chunk_bytes: int,
    ) -> None:
        self.hops = hops
        self.is_last = is_last
        self.is_first = is_first  # a 1-stage chain's acknowledgement stays here: nothing waits for it
        self.hidden_size = hidden_size  # of the empty hidden states sent when no sequence ran here
        self.max_message_bytes = max_message_bytes  # the gRPC message limit of the next hop
        self.max_chunk_bytes = max_chunk_bytes  # data bytes per hidden-state chunk sent
        self.subscribers = Subscribers()
        self.on_drawn: Drawn | None = None  # told the tokens an acknowledgement carries (`compute.drawn`)

    async def deliver(self, step: ReceivedStep, out: StepOutput, *, answer: Answer) -> None:
        """Answer the step (last stage), or send it on; `answer` gets its result, now or later."""
        order = [s.sequence_id for s in step.seqs]
        local = {e.sequence_id: e for e in out.errors}
        if self.is_last:
            header = step.header

            def result() -> stage_pb2.StepResult:
                return _merge(header.step_id, order, local, _draw_results(step, out))

            if header.HasField("reply") and self.subscribers.takes(header.reply):
                ack = stage_pb2.StepResult(step_id=header.step_id, replied=True)
                if header.run_ahead and not self.is_first:  # the first stage starts the next step with the tokens
                    ack.sequences.extend(_drawn_tokens(step, out, local))
                    answer(ack)
                    try:
                        await asyncio.sleep(0)  # its write begins (the stream's task runs) before the result is built
                    finally:
                        self.subscribers.reply(header.reply, result())
                    return
                self.subscribers.reply(header.reply, result())
                answer(ack)
            else:
                answer(result())
            return
        header = _forwarded_header(step.header, kept={s.sequence_id for s in out.kept}, dropped=local)
        assert out.hidden is not None or not out.kept
        hidden: torch.Tensor | WireTensor = torch.empty(0, self.hidden_size) if out.hidden is None else out.hidden
        if step.sent is not None:  # its bytes, made on the compute thread
            hidden = step.sent
        started = time.perf_counter()
        after_header = self._frames(header, hidden)
        step.sent = None  # in the frames now
        frames = step.times.forwarding(  # each request's hop span goes into its carrier; frames are counted
            step.header.route[0],
            ((s.sequence_id, s.trace_context) for s in header.sequences),
            after_header,
            header_size=header.ByteSize,
            serialize_seconds=time.perf_counter() - started,
        )

        def merged(result: stage_pb2.StepResult) -> None:
            if result.replied and result.sequences and self.on_drawn is not None:
                self.on_drawn(step, out, {r.sequence_id: r.sampled_token_id for r in result.sequences})
            if result.replied or (result.HasField("error") and result.error.code):
                answer(result)
                return
            down = {r.sequence_id: r for r in result.sequences}
            answer(_merge(result.step_id, order, local, down))

        try:
            hop = self.hops.get(step.header.route[0])
        except Unreachable as err:
            answer(stage_pb2.StepResult(step_id=step.header.step_id, error=status_message(err)))
            step.times.end(error=str(err), sequence_errors=())
            return
        await hop.send(header, frames, deliver=merged)
        # This stage's part is done; the result goes to the coordinator.
        step.times.end(error=None, sequence_errors=((sid, str(e.error)) for sid, e in local.items()))

    def _frames(self, header: stage_pb2.StepHeader, hidden: torch.Tensor | WireTensor) -> list[stage_pb2.StepFrame]:
        """The hidden states in `header` when both fit in one message (no frame after it), else as chunk frames."""
        if whole_chunk(hidden, header.hidden, self.max_chunk_bytes):
            if header.ByteSize() + FRAME_OVERHEAD_BYTES <= self.max_message_bytes:
                return []
            header.ClearField("hidden")
        return [stage_pb2.StepFrame(hidden_chunk=c) for c in chunk(hidden, self.max_chunk_bytes)]


def _forwarded_header(
    header: stage_pb2.StepHeader, *, kept: set[str], dropped: dict[str, SequenceError]
) -> stage_pb2.StepHeader:
    """The header of the step sent on: its sequences that ran here, the route past this stage."""
    forwarded = stage_pb2.StepHeader(
        step_id=header.step_id,
        model_id=header.model_id,
        sequences=[s for s in header.sequences if s.sequence_id in kept and s.sequence_id not in dropped],
        route=header.route[1:],
        release_sequence_ids=header.release_sequence_ids,
        alone=header.alone,
        run_ahead=header.run_ahead,
        chain=header.chain,
        route_tag=header.route_tag,
    )
    if header.HasField("reply") and len(forwarded.sequences) == len(header.sequences):
        forwarded.reply.CopyFrom(header.reply)  # dropped with a sequence: see stage.proto
    return forwarded


def _drawn_tokens(
    step: ReceivedStep, out: StepOutput, local: dict[str, SequenceError]
) -> list[stage_pb2.SequenceResult]:
    """The tokens drawn for the sequences that asked (the sampled tokens of `_draw_results`), alone."""
    wants = {s.sequence_id: s.sample for s in step.header.sequences}
    return [
        stage_pb2.SequenceResult(sequence_id=seq.sequence_id, sampled_token_id=draw.token_id)
        for seq in out.kept
        if seq.sequence_id not in local
        and wants[seq.sequence_id]
        and (draw := out.draws.get(seq.sequence_id)) is not None
    ]


def _draw_results(step: ReceivedStep, out: StepOutput) -> dict[str, stage_pb2.SequenceResult]:
    results: dict[str, stage_pb2.SequenceResult] = {}
    wants = {s.sequence_id: s for s in step.header.sequences}
    for seq in out.kept:
        result = stage_pb2.SequenceResult(sequence_id=seq.sequence_id)
        draw = out.draws.get(seq.sequence_id)
        asked = wants[seq.sequence_id]
        if draw is not None and asked.sample:
            result.sampled_token_id = draw.token_id
            if draw.logprob is not None:
                result.logprob = draw.logprob
                result.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in draw.top)
            for accepted in out.accepted.get(seq.sequence_id, ()):
                token = result.accepted.add(token_id=accepted.token_id)
                if accepted.logprob is not None:
                    token.logprob = accepted.logprob
                    token.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in accepted.top)
        results[seq.sequence_id] = result
    return results


def _merge(
    step_id: int,
    order: list[str],
    local: dict[str, SequenceError],
    down: dict[str, stage_pb2.SequenceResult],
) -> stage_pb2.StepResult:
    """One result in the step's order: this stage's errors, else what came from downstream."""
    result = stage_pb2.StepResult(step_id=step_id)
    for sid in order:
        if sid in local:
            result.sequences.add(sequence_id=sid, error=status_message(local[sid].error))
        elif sid in down:
            result.sequences.append(down[sid])
    return result
