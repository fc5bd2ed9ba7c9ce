"""A client run inside a test host (`ip netns exec ... python tests/netlab_client.py JSON`).

The test process lives outside the lab's namespaces, so it sends its requests from here: wait
until the coordinator at `target` reports `chains` complete chains, then stream every prompt at
once (greedy, `max_tokens` each), printing `progress TOKENS` on stdout as the first stream grows
(a test cuts a link on it) and, last, one JSON line: each prompt's token ids.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from layerline.client import AsyncClient, Client, LayerlineError


def wait_ready(target: str, token: str | None, ca_cert: str | None, chains: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with Client(target, token=token, ca_cert=ca_cert) as client:
        while True:
            try:
                if len(client.cluster(timeout=5).chains) >= chains:
                    return
            except LayerlineError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} had no {chains} complete chain(s) after {timeout:.0f}s")
            time.sleep(0.3)


async def generate(args: dict) -> list[list[int]]:  # type: ignore[type-arg]
    async with AsyncClient(args["target"], token=args.get("token"), ca_cert=args.get("ca_cert")) as client:

        async def one(i: int, prompt: str) -> list[int]:
            ids: list[int] = []
            async for chunk in client.stream(prompt, max_tokens=args["max_tokens"], temperature=0.0):
                ids += chunk.token_ids
                if i == 0:
                    print(f"progress {len(ids)}", flush=True)
            return ids

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(args["prompts"])))


def main() -> int:
    args = json.loads(sys.argv[1])
    wait_ready(args["target"], args.get("token"), args.get("ca_cert"), args.get("chains", 1), args.get("timeout", 180))
    print("ready", flush=True)
    print(json.dumps(asyncio.run(generate(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
