"""Where a computed step goes from the last stage, in isolation: the acknowledgement that carries a
lone stream's token up the chain goes before the coordinator's result, and both carry the same
token; a Results stream closed meanwhile loses its result quietly."""

from __future__ import annotations

import asyncio

from layerline.protos.v1 import stage_pb2
from layerline.stage_worker.delivery import Delivery, Subscribers
from layerline.stage_worker.engine import SequenceStep, StepOutput
from layerline.stage_worker.frames import ReceivedStep
from layerline.stage_worker.hops import NextHops
from layerline.stage_worker.sampler import Draw
from layerline.stage_worker.step_telemetry import StepClock


def _last_stage(*, is_first: bool) -> Delivery:
    return Delivery(
        NextHops(max_message_bytes=1 << 20),
        is_last=True,
        is_first=is_first,
        hidden_size=8,
        max_message_bytes=1 << 20,
        max_chunk_bytes=1 << 16,
    )


def _step(*, run_ahead: bool) -> tuple[ReceivedStep, StepOutput]:
    header = stage_pb2.StepHeader(
        step_id=4,
        sequences=[stage_pb2.SequenceInput(sequence_id="s", positions=[9], sample=True)],
        reply=stage_pb2.DirectReply(subscriber="coordinator", step_id=41),
        run_ahead=run_ahead,
    )
    seq = SequenceStep("s", (9,))
    return ReceivedStep(header, [seq], times=StepClock()), StepOutput(kept=[seq], draws={"s": Draw(17)})


def _deliver(
    delivery: Delivery, step: ReceivedStep, out: StepOutput
) -> tuple[list[tuple[stage_pb2.StepResult, int]], list[stage_pb2.StepResult]]:
    """The answers up the chain, each with how many results the coordinator's stream held when it
    went; and the results on that stream."""
    up: list[tuple[stage_pb2.StepResult, int]] = []

    async def run() -> list[stage_pb2.StepResult]:
        queue = delivery.subscribers.open("coordinator")
        await delivery.deliver(step, out, answer=lambda result: up.append((result, queue.qsize())))
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return up, asyncio.run(run())


def test_a_lone_streams_token_goes_up_the_chain_before_the_coordinators_result() -> None:
    up, direct = _deliver(_last_stage(is_first=False), *_step(run_ahead=True))
    [(ack, queued)], [result] = up, direct
    assert queued == 0  # the acknowledgement went first
    assert (ack.step_id, ack.replied) == (4, True)
    assert [(r.sequence_id, r.sampled_token_id) for r in ack.sequences] == [("s", 17)]
    assert result.step_id == 41 and [(r.sequence_id, r.sampled_token_id) for r in result.sequences] == [("s", 17)]


def test_without_run_ahead_or_on_one_stage_the_acknowledgement_is_bare_and_comes_after() -> None:
    for delivery, run_ahead in ((_last_stage(is_first=False), False), (_last_stage(is_first=True), True)):
        up, direct = _deliver(delivery, *_step(run_ahead=run_ahead))
        [(ack, queued)], [result] = up, direct
        assert queued == 1 and ack.replied and not ack.sequences
        assert [r.sampled_token_id for r in result.sequences] == [17]


def test_a_step_cancelled_after_its_acknowledgement_still_gives_the_coordinator_its_result() -> None:
    """The acknowledgement said the coordinator has the result: a step cancelled in the turn the
    event loop takes after it (its stream closing) queues the result all the same."""
    delivery = _last_stage(is_first=False)
    step, out = _step(run_ahead=True)

    async def run() -> tuple[bool, list[stage_pb2.StepResult]]:
        queue = delivery.subscribers.open("coordinator")

        def answer(_: stage_pb2.StepResult) -> None:
            task.cancel()  # the acknowledgement is up: the step is cancelled where it yields

        task = asyncio.create_task(delivery.deliver(step, out, answer=answer))
        await asyncio.wait([task])
        return task.cancelled(), [queue.get_nowait() for _ in range(queue.qsize())]

    cancelled, direct = asyncio.run(run())
    assert cancelled and [(r.step_id, [q.sampled_token_id for q in r.sequences]) for r in direct] == [(41, [17])]


def test_a_results_stream_closed_before_its_result_loses_it_quietly() -> None:
    async def run() -> int:
        subscribers = Subscribers()
        queue = subscribers.open("coordinator")
        reply = stage_pb2.DirectReply(subscriber="coordinator", step_id=1)
        assert subscribers.takes(reply)
        subscribers.close("coordinator", queue)
        assert not subscribers.takes(reply)
        subscribers.reply(reply, stage_pb2.StepResult())
        return queue.qsize()

    assert asyncio.run(run()) == 0
