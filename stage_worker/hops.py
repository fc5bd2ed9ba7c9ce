"""The long-lived Step streams a stage keeps to the next hops of its routes.

Owns one channel and one bidirectional Step stream per next-hop address, shared by every
upstream stream whose steps go that way. A forwarded step gets a fresh id on the hop's stream
(ids from different upstream streams may collide); its StepResult is handed back to whoever
forwarded it. When a hop's stream breaks, every step still waiting on it is answered with an
UNAVAILABLE result naming the hop, and the next step to that address opens a new stream on a
new channel with connections of its own (a kept channel, or one sharing gRPC's pool of
connections with it, would wait out its reconnect backoff, a second and growing, before it
reached a hop restarted on the same address).

Knows nothing of models or tensors beyond the frames it is handed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from layerline.shared.errors import Unreachable
from layerline.shared.rpc import aio_channel

log = logging.getLogger(__name__)

OnResult = Callable[[stage_pb2.StepResult], None]


@dataclass
class _Waiting:
    upstream_step_id: int
    deliver: OnResult


class NextHop:
    """One Step stream to one address; frames of a step are written without interleaving."""

    def __init__(
        self, address: str, *, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self.address = address
        self._max_message_bytes = max_message_bytes
        self._credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}  # steps sent on the current stream
        self._closing: set[asyncio.Task[None]] = set()  # the channels of broken streams, closing

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def send(
        self,
        header: stage_pb2.StepHeader,
        chunks: Iterable[stage_pb2.StepFrame],
        *,
        deliver: OnResult,
    ) -> None:
        """Forward one step; `deliver` gets its StepResult (or an UNAVAILABLE one) later."""
        async with self._write_lock:
            upstream_id = header.step_id
            step_id = next(self._ids)
            header.step_id = step_id
            try:
                call = self._ensure_stream()
                self._waiting[step_id] = _Waiting(upstream_id, deliver)
                await call.write(stage_pb2.StepFrame(header=header))
                for frame in chunks:
                    await call.write(frame)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
                self._drop(self._call)
                self._fail_all(f"next hop {self.address} is unreachable: {_describe(err)}")

    def _ensure_stream(self) -> grpc.aio.StreamStreamCall:
        if self._call is None or self._call.done():
            if self._channel is None:
                self._channel = aio_channel(
                    self.address,
                    credentials=self._credentials,
                    max_message_bytes=self._max_message_bytes,
                    own_subchannels=True,  # not the backing-off connection of the channel just dropped
                )
            self._call = stage_pb2_grpc.StageWorkerStub(self._channel).Step()
            self._waiting = {}  # a fresh dict per stream: the old stream's reader fails its own
            self._reader = asyncio.create_task(self._read(self._call, self._waiting))
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall, waiting_on: dict[int, _Waiting]) -> None:
        reason = f"next hop {self.address} closed its stream"
        try:
            async for result in call:
                waiting = waiting_on.pop(result.step_id, None)
                if waiting is None:
                    log.warning("result for unknown step %d from %s", result.step_id, self.address)
                    continue
                result.step_id = waiting.upstream_step_id
                waiting.deliver(result)
        except grpc.aio.AioRpcError as err:
            reason = f"next hop {self.address} failed: {_describe(err)}"
        self._drop(call)
        self._fail_all(reason, waiting_on)

    def _drop(self, call: grpc.aio.StreamStreamCall | None) -> None:
        """Forget a broken stream, if it is still the current one, and its channel with it."""
        if call is None or self._call is not call:
            return
        channel, self._channel, self._call = self._channel, None, None
        call.cancel()
        if channel is not None:
            closing = asyncio.get_running_loop().create_task(channel.close(None))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _fail_all(self, reason: str, waiting_on: dict[int, _Waiting] | None = None) -> None:
        waiting_on = self._waiting if waiting_on is None else waiting_on
        waiting = dict(waiting_on)
        waiting_on.clear()
        if waiting:
            log.warning("%s; failing %d in-flight step(s)", reason, len(waiting))
        for w in waiting.values():
            w.deliver(
                stage_pb2.StepResult(
                    step_id=w.upstream_step_id,
                    error=common_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message=reason),
                    failed_address=self.address,
                )
            )

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close(None)
        self._channel = self._call = None
        await asyncio.gather(*self._closing)


class NextHops:
    """The NextHop of each address this stage forwards to, made on first use; at most `MAX_OPEN`
    of them, the one idle the longest closed to make room."""

    MAX_OPEN = 64

    def __init__(self, *, max_message_bytes: int, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._max_message_bytes = max_message_bytes
        self._credentials = credentials  # mutual TLS as a stage; None: plaintext
        self._hops: dict[str, NextHop] = {}  # least recently used first

    def get(self, address: str) -> NextHop:
        hop = self._hops.pop(address, None)
        if hop is None:
            if len(self._hops) >= self.MAX_OPEN:
                self._close_idlest()
            hop = NextHop(address, max_message_bytes=self._max_message_bytes, credentials=self._credentials)
        self._hops[address] = hop  # most recently used last
        return hop

    def _close_idlest(self) -> None:
        idle = next((a for a, h in self._hops.items() if h.in_flight == 0), None)
        if idle is None:
            raise Unreachable(f"this stage already streams to {len(self._hops)} next hops, all busy")
        asyncio.get_running_loop().create_task(self._hops.pop(idle).close())

    async def close(self) -> None:
        for hop in self._hops.values():
            await hop.close()


def _describe(err: Exception) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err)
