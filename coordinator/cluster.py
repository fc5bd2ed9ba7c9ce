"""The live cluster as the coordinator runs it: chains, their schedulers, routing, failover.

Owns the mapping from registered workers to running chains (a `ChainClient` and a
`ChainScheduler` each), rebuilding it when membership changes, and placing each new sequence
on the least-loaded chain, where it stays pinned while its KV lives there. When a chain loses a
worker, its sequences move: each is placed on another chain with nothing fed, so the new chain
rebuilds its KV by prefilling the sequence's token history (prompt plus what was generated),
then goes on. Moves are bounded (`FailoverPolicy`) and back off; past the bound the request
ends with UNAVAILABLE naming the cause.

Knows nothing of text or of client RPCs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from layerline.shared.errors import Code, Unreachable

from .chain import ChainClient, MemberLinks, ProbeFailed, probe
from .registry import Registry, Worker, build_chains
from .scheduler import ChainScheduler
from .settings import DEFAULT_PREFIX_CACHE
from .stall import StallPolicy
from .steps import Sequence, StepFailed

log = logging.getLogger(__name__)

FAILOVER_CODES = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)  # a hop is gone or stuck: move, do not fail
ROUTINGS = ("cache", "load")
# Cache-aware routing sends a sequence to the chain holding the longest prefix of it unless that
# chain runs this many more sequences than the least loaded one (SGLang's router balances so too).
BALANCE_SLACK = 8


@dataclass(frozen=True)
class FailoverPolicy:
    max_moves: int = 5  # moves of one sequence to another chain before it fails
    backoff: float = 0.1  # seconds before the second re-placement (the first goes at once); doubles after
    max_backoff: float = 2.0  # the longest wait between moves
    wait_for_chain: float = 10.0  # how long a moved sequence may wait for any complete chain


class NoChainError(Unreachable):
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
        share_prefixes: bool = True,
        prefix_cache: float = DEFAULT_PREFIX_CACHE,
        depth: int | None = None,
        links: MemberLinks,
        failover: FailoverPolicy = FailoverPolicy(),
        stall: StallPolicy = StallPolicy(),
        routing: str = "cache",
        tracer: Tracer | None = None,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"--routing {routing!r} is not one of {', '.join(ROUTINGS)}")
        self.registry = registry
        self.links = links  # the route key and the credentials that reach the stages
        self.tracer = tracer  # the chains' step spans; None when tracing is off
        self.failover = failover
        self.stall = stall  # when a chain that does not answer counts as hung
        self.preemptions = 0  # sequences whose KV was freed for an older one's and recomputed, since start
        self.stalls = 0  # chains that stopped answering steps, since start
        self._probing: set[str] = set()  # addresses whose readiness probe is running
        self.failovers = 0  # sequences moved off a failed chain, since start
        self.shared_prefix_tokens = 0  # prompt tokens copied from a live or cached sequence's KV, since start
        self.prefix_queries = 0  # tokens of the sequences started, looked up in their chain's KV, since start
        self.draft_tokens = 0  # tokens drafted by prompt lookup and verified by the chains, since start
        self.accepted_tokens = 0  # of those, the ones the chains accepted
        self.routing = routing  # "cache": to the chain that holds a new sequence's prefix; "load": the least loaded
        self.last_failover_gap = 0.0  # seconds from a failure to the moved sequence's next token
        self.max_failover_gap = 0.0
        self.max_message_bytes = max_message_bytes
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        self.prefix_cache = prefix_cache  # share of a chain's KV memory that finished prefixes may keep
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
        wanted = build_chains(self.registry.routable(), self.registry.num_layers, keep=[c.workers for c in self.chains])
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
            [w.address for w in workers],
            model_id=workers[0].model_id,
            max_message_bytes=self.max_message_bytes,
            links=self.links,
            tracer=self.tracer,
            stall=self.stall,
        )
        holder: list[RunningChain] = []
        kv_tokens = min(w.kv_blocks_total * max(w.kv_block_size, 1) for w in workers)  # the smallest stage's
        block_size = max(max(w.kv_block_size, 1) for w in workers)
        ttls = [w.orphan_ttl for w in workers if w.orphan_ttl > 0]
        scheduler = ChainScheduler(
            client,
            depth=self.depth or len(workers),
            token_budget=self.token_budget,
            share_prefixes=self.share_prefixes,
            cache_tokens=int(self.prefix_cache * kv_tokens),
            block_size=block_size,
            kv_blocks=kv_tokens // block_size,
            lender_ttl=min(ttls) / 2 if ttls else None,  # freed here before a stage would call it orphaned
            on_step_failed=lambda seqs, err: self._step_failed(holder[0], seqs, err),
            release=client.release,
            on_failover_gap=self._failover_gap,
            on_shared_prefix=self._shared_prefix,
            on_prefix_query=self._prefix_query,
            on_preempted=self._preempted,
            on_speculated=self._speculated,
        )
        running = RunningChain(replica, workers, client, scheduler)
        holder.append(running)
        scheduler.start()
        return running

    def _drop_chain(self, chain: RunningChain, reason: str) -> None:
        seqs = list(chain.scheduler.sequences.values())
        chain.scheduler.sequences.clear()
        held = list(chain.scheduler.held)  # every KV the chain holds: live, cached, waiting to be freed
        self._move(seqs, reason, since=chain.client.stalled_since)
        asyncio.get_running_loop().create_task(self._close(chain, release=held))

    async def _close(self, chain: RunningChain, *, release: list[str] | None = None) -> None:
        await chain.scheduler.stop()
        if release:  # best effort: frees what the surviving workers of the chain still hold
            await chain.client.release(release)
        await chain.client.close()

    def _step_failed(self, chain: RunningChain, seqs: list[Sequence], err: StepFailed) -> None:
        for seq in seqs:
            chain.scheduler.sequences.pop(seq.sequence_id, None)
        if err.code not in FAILOVER_CODES:
            for seq in seqs:
                self._where.pop(seq.sequence_id, None)
                seq.on_error(err.code, str(err))
            return
        log.warning("step on chain %s failed (%s); moving %d sequence(s)", " -> ".join(chain.addresses), err, len(seqs))
        if err.failed_address:
            self.registry.mark(err.failed_address, "UNREACHABLE")
        elif err.code == Code.DEADLINE_EXCEEDED:  # the chain stalled: each of its workers passes a probe again first
            self.stalls += chain in self.chains  # once per chain, not per step it failed
            for address in chain.addresses:
                self.registry.suspect(address)
        held = [s.kv_id for s in seqs]  # before the move names their KV anew
        self._move(seqs, str(err), since=err.since)
        asyncio.get_running_loop().create_task(chain.client.release(held))
        self.refresh()  # drops the broken chain and moves the rest of its sequences

    def _move(self, seqs: list[Sequence], reason: str, *, since: float | None = None) -> None:
        """Re-place sequences whose KV was lost, after a backoff; fail those out of moves. A failover's
        gap runs from `since` (when a stalled chain stopped answering) or else from now."""
        loop = asyncio.get_running_loop()
        for seq in seqs:
            self._where.pop(seq.sequence_id, None)
            if seq.done:
                continue
            seq.replace_kv()
            seq.moves += 1
            if seq.failed_at is None:
                seq.failed_at = since if since is not None else time.monotonic()
            if seq.moves > self.failover.max_moves:
                seq.on_error(
                    Code.UNAVAILABLE, f"gave up after {self.failover.max_moves} failovers; last cause: {reason}"
                )
                continue
            self.failovers += 1
            # The broken chain is out of routing already: the first move goes at once, later ones back off.
            backoff = self.failover.backoff * 2 ** (seq.moves - 2)
            delay = 0.0 if seq.moves == 1 else min(backoff, self.failover.max_backoff)
            deadline = time.monotonic() + self.failover.wait_for_chain
            loop.call_later(delay, self._replace, seq, reason, deadline)

    def _preempted(self, seq: Sequence) -> None:
        self.preemptions += 1

    def _speculated(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def _prefix_query(self, tokens: int) -> None:
        self.prefix_queries += tokens

    def _shared_prefix(self, tokens: int) -> None:
        self.shared_prefix_tokens += tokens

    def _failover_gap(self, seq: Sequence, seconds: float) -> None:
        self.last_failover_gap = seconds
        self.max_failover_gap = max(self.max_failover_gap, seconds)
        log.info("failover gap of %s: %.3fs from the failure to its next token", seq.sequence_id, seconds)

    def _replace(self, seq: Sequence, reason: str, deadline: float) -> None:
        if seq.done or seq.sequence_id in self._where:
            return
        try:
            chain = self.place(seq)
        except NoChainError as err:
            if time.monotonic() >= deadline:
                seq.on_error(Code.UNAVAILABLE, f"{err} (after: {reason})")
            else:
                asyncio.get_running_loop().call_later(0.25, self._replace, seq, reason, deadline)
            return
        log.info("sequence %s moved to chain %d; replaying %d tokens", seq.sequence_id, chain.replica, len(seq.history))

    def place(self, seq: Sequence) -> RunningChain:
        self.refresh()
        if not self.chains:
            raise NoChainError(f"no complete chain of workers covers layers [0, {self.registry.num_layers}) right now")
        chain = self._route(seq)
        self._where[seq.sequence_id] = chain
        chain.scheduler.add(seq)
        return chain

    def _route(self, seq: Sequence) -> RunningChain:
        """The least loaded chain (fewest waiting for KV, then fewest sequences) or, routing by
        cache, the chain whose live or cached sequences hold the longest prefix of `seq`, unless
        it runs more than BALANCE_SLACK sequences beyond the least loaded one."""
        least = min(self.chains, key=lambda c: (c.scheduler.waiting, c.scheduler.load, c.replica))
        if self.routing != "cache" or len(self.chains) == 1:
            return least
        held = {c.replica: c.scheduler.longest_prefix(seq) for c in self.chains}
        best = max(self.chains, key=lambda c: (held[c.replica], -c.scheduler.load))
        if held[best.replica] == 0 or best.scheduler.load - least.scheduler.load > BALANCE_SLACK:
            return least
        return best

    def finish(self, seq: Sequence) -> None:
        chain = self._where.pop(seq.sequence_id, None)
        if chain is not None:
            chain.scheduler.finish(seq)
        seq.done = True

    def probe_workers(self, *, every: float) -> list[asyncio.Task[None]]:
        """Start the readiness probe (a real one-token forward) of each worker that is due and
        not being probed; each outcome counts as soon as it is in, so a hung worker's probe
        delays no other's. Returns the probes started.

        A worker joins routing only after its probe passes, and leaves it when a probe fails. Any
        exception from one worker's probe is that worker failing it (logged, with the traceback
        when it is not a `ProbeFailed`).
        """
        due = [w for w in self.registry.due_for_probe(every=every) if w.address not in self._probing]
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._probe(w)) for w in due]

    async def _probe(self, worker: Worker) -> None:
        self._probing.add(worker.address)
        try:
            await probe(worker.address, credentials=self.links.credentials)
        except ProbeFailed as err:
            log.warning("worker %s failed its readiness probe: %s", worker.address, err)
            self.registry.probed(worker, ready=False)
        except Exception as err:
            log.error("worker %s failed its readiness probe: %r", worker.address, err, exc_info=err)
            self.registry.probed(worker, ready=False)
        else:
            self.registry.probed(worker, ready=True)
        finally:
            self._probing.discard(worker.address)
        self.refresh()

    def chain_of(self, address: str) -> RunningChain | None:
        return next((c for c in self.chains if address in c.addresses), None)

    async def close(self) -> None:
        for chain in self.chains:  # what the cache of finished prefixes holds is freed on the stages
            await self._close(chain, release=list(chain.scheduler.cached))
