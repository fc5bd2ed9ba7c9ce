"""The live cluster as the coordinator runs it: chains, their schedulers, and routing.

Owns the mapping from registered workers to running chains (a `ChainClient` and a
`ChainScheduler` each), rebuilding it when membership changes, and placing each new sequence
on the least-loaded chain, where it stays pinned while its KV lives there.

Knows nothing of text or of client RPCs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from .chain import ChainClient
from .registry import Registry, Worker, build_chains
from .scheduler import ChainScheduler, Sequence, StepFailed

log = logging.getLogger(__name__)

UNAVAILABLE = 14


class NoChainError(RuntimeError):
    """No complete chain of workers covers every layer right now."""


@dataclass
class RunningChain:
    replica: int
    workers: list[Worker]
    client: ChainClient
    scheduler: ChainScheduler

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    @property
    def key(self) -> tuple[tuple[str, str], ...]:
        return tuple((w.address, w.instance_id) for w in self.workers)


class Cluster:
    def __init__(
        self,
        registry: Registry,
        *,
        max_message_bytes: int,
        token_budget: int,
        depth: int | None = None,
    ) -> None:
        self.registry = registry
        self.max_message_bytes = max_message_bytes
        self.token_budget = token_budget
        self.depth = depth
        self.chains: list[RunningChain] = []
        self._version = -1
        self._where: dict[str, RunningChain] = {}  # sequence id -> its chain

    def refresh(self) -> None:
        """Rebuild the chains if membership changed; chains that survive keep their sequences."""
        self.registry.expire()
        if self.registry.version == self._version:
            return
        self._version = self.registry.version
        wanted = build_chains(self.registry.workers(), self.registry.num_layers)
        old = {c.key: c for c in self.chains}
        chains: list[RunningChain] = []
        for i, workers in enumerate(wanted):
            key = tuple((w.address, w.instance_id) for w in workers)
            running = old.pop(key, None)
            if running is None:
                running = self._start_chain(i, workers)
                log.info("chain %d: %s", i, " -> ".join(f"{w.address}[{w.layer_start},{w.layer_end})" for w in workers))
            running.replica = i
            chains.append(running)
        self.chains = chains
        for gone in old.values():
            log.warning("chain %s is gone", " -> ".join(gone.addresses))
            self._drop_chain(gone, "a worker of its chain left the cluster")

    def _start_chain(self, replica: int, workers: list[Worker]) -> RunningChain:
        client = ChainClient(
            [w.address for w in workers], model_id=workers[0].model_id, max_message_bytes=self.max_message_bytes
        )
        holder: list[RunningChain] = []
        scheduler = ChainScheduler(
            client,
            depth=self.depth or len(workers),
            token_budget=self.token_budget,
            on_step_failed=lambda seqs, err: self._step_failed(holder[0], seqs, err),
            release=client.release,
        )
        running = RunningChain(replica, workers, client, scheduler)
        holder.append(running)
        scheduler.start()
        return running

    def _drop_chain(self, chain: RunningChain, reason: str) -> None:
        for seq in list(chain.scheduler.sequences.values()):
            self._where.pop(seq.sequence_id, None)
            seq.on_error(UNAVAILABLE, f"{reason}; retry the request")
        asyncio.get_running_loop().create_task(self._close(chain))

    async def _close(self, chain: RunningChain) -> None:
        await chain.scheduler.stop()
        await chain.client.close()

    def _step_failed(self, chain: RunningChain, seqs: list[Sequence], err: StepFailed) -> None:
        if err.failed_address:
            self.registry.mark(err.failed_address, "UNREACHABLE")
        for seq in seqs:
            chain.scheduler.sequences.pop(seq.sequence_id, None)
            self._where.pop(seq.sequence_id, None)
            seq.on_error(err.code, str(err))

    def place(self, seq: Sequence) -> RunningChain:
        self.refresh()
        if not self.chains:
            raise NoChainError(
                f"no complete chain of workers covers layers [0, {self.registry.num_layers}) right now"
            )
        chain = min(self.chains, key=lambda c: (c.scheduler.load, c.replica))
        self._where[seq.sequence_id] = chain
        chain.scheduler.add(seq)
        return chain

    def finish(self, seq: Sequence) -> None:
        chain = self._where.pop(seq.sequence_id, None)
        if chain is not None:
            chain.scheduler.finish(seq)
        seq.done = True

    def replica_of(self, address: str) -> int | None:
        return next((c.replica for c in self.chains if address in c.addresses), None)

    async def close(self) -> None:
        for chain in self.chains:
            await self._close(chain)
