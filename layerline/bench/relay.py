"""A TCP relay that holds each direction's bytes for a link's one-way delay.

    python -m layerline.bench.relay LISTEN_HOST PORT:TARGET_HOST:TARGET_PORT:DELAY_MS [...]

These machines' kernels have no `sch_netem`, so a test network (`netlab`) gets its delay here:
a member dials the relay's address instead of its peer's, and every byte goes on, in order,
`DELAY_MS` after it arrived, in both directions; bandwidth stays the links' own (`tbf`). Bytes
are never buffered longer than the delay, so a relay adds the delay and the cost of one more
local copy, nothing else (`tests/test_netlab.py` measures it); a reader slower than its link
holds the relay back after `MAX_QUEUED_CHUNKS`, as a full socket would. Opening a connection is
not delayed (gRPC keeps its connections open, so only the bytes on them matter here). Knows
nothing of gRPC or TLS: it relays bytes, so TLS runs end to end through it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK_BYTES = 64 << 10
MAX_QUEUED_CHUNKS = 256  # per direction: 16 MiB at most in flight in the relay


@dataclass(frozen=True)
class Route:
    port: int  # where the relay listens
    target_host: str
    target_port: int
    delay_s: float  # one way, each direction

    @classmethod
    def parse(cls, text: str) -> Route:
        """`PORT:TARGET_HOST:TARGET_PORT:DELAY_MS`."""
        port, host, target, delay = text.split(":")
        return cls(int(port), host, int(target), float(delay) / 1000)

    def __str__(self) -> str:
        return f"{self.port}:{self.target_host}:{self.target_port}:{self.delay_s * 1000:g}"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy `reader` to `writer`, each chunk `delay_s` after it was read; at the reader's end, end
    the writer's direction too (half-close). Raises when either side fails."""
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)

    async def read() -> None:
        while data := await reader.read(CHUNK_BYTES):
            await due.put((time.monotonic() + delay_s, data))
        await due.put((time.monotonic() + delay_s, b""))  # the end, delayed like the bytes before it

    async def deliver() -> None:
        while True:
            at, data = await due.get()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.create_task(read()), asyncio.create_task(deliver())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a side that failed fails the pump
    finally:
        for task in tasks:
            task.cancel()


def _handler(route: Route):
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(route.target_host, route.target_port)
        except OSError:
            client_writer.close()
            return
        pumps = [
            asyncio.create_task(_pump(client_reader, target_writer, route.delay_s)),
            asyncio.create_task(_pump(target_reader, client_writer, route.delay_s)),
        ]
        try:
            # Both directions to their ends; or, when one fails, the connection is over both ways.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_writer, target_writer):
                writer.close()

    return handle


async def serve(host: str, routes: Sequence[Route]) -> None:
    servers = [await asyncio.start_server(_handler(r), host, r.port) for r in routes]
    print(f"relay on {host}: " + ", ".join(map(str, routes)), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(args[0], [Route.parse(a) for a in args[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
