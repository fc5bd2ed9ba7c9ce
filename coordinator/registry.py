"""The coordinator's view of its stage workers, and the chains they form.

Owns the table of registered workers (what each serves, its load, when it was last heard
from) and the pure function that cuts them into chains: sequences of workers of one model id
whose half-open layer ranges cover `[0, num_layers)` end to end. Each worker serves in at most
one chain; uneven splits are fine. The table is keyed by the address a worker claims, so it is
bounded: at most `max_workers` entries (past it `RegistryFull`, once silent workers are expired)
and every text a worker reports at most `MAX_FIELD_CHARS` characters (past it `InvalidInput`).

Knows nothing of gRPC messages (the servicer converts them), of sequences or of the schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace

from layerline.shared.errors import InvalidInput, NoCapacity

MAX_WORKERS = 1024  # registered addresses at most
MAX_FIELD_CHARS = 256  # characters of any text a worker reports (its address, model id, host, ...)


@dataclass(frozen=True)
class Worker:
    address: str  # where its StageWorker service listens
    instance_id: str  # random per process start
    model_id: str  # digest of config and weights' metadata
    model_name: str
    layer_start: int
    layer_end: int  # half-open: [layer_start, layer_end)
    num_layers: int
    host: str = ""
    pid: int = 0
    tp_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_block_size: int = 0  # tokens per KV block
    in_flight_steps: int = 0
    active_sequences: int = 0
    state: str = "SERVING"
    weights_bytes: int = 0  # weights one rank holds
    steps_computed: int = 0  # since it started, and their compute time (as of its last heartbeat)
    compute_seconds: float = 0.0
    steps_run_ahead: int = 0  # steps computed ahead as guesses that were taken, and those dropped
    steps_run_ahead_dropped: int = 0
    orphan_ttl: float = 0.0  # it frees the KV of a sequence no step touched for this long (seconds); 0: never


@dataclass
class _Entry:
    worker: Worker
    last_seen: float = field(default_factory=time.monotonic)
    ready: bool = False  # its last readiness probe (a real one-token forward) passed
    probed_at: float = 0.0  # when that probe ran (monotonic seconds; 0: never)


class RegistryFull(NoCapacity):
    """`max_workers` addresses are registered already; a new one may fit once another leaves."""


class Registry:
    """Workers by address, at most `max_workers`; a worker unheard of for `expiry` seconds is dropped."""

    def __init__(self, *, num_layers: int, expiry: float = 10.0, max_workers: int = MAX_WORKERS) -> None:
        self.num_layers = num_layers
        self.expiry = expiry
        self.max_workers = max_workers
        self._entries: dict[str, _Entry] = {}
        self.version = 0  # bumped on every change of membership

    def register(self, worker: Worker) -> bool:
        """Add or refresh a worker; True if this very instance was registered already.

        InvalidInput if a text it reports is too long, RegistryFull if its address is new and
        `max_workers` others are registered, ValueError if it serves another layer count.
        """
        _check_fields(worker)
        if worker.num_layers != self.num_layers:
            raise ValueError(
                f"worker {worker.address} serves a model of {worker.num_layers} layers; "
                f"this coordinator's model has {self.num_layers}"
            )
        if worker.address not in self._entries and len(self._entries) >= self.max_workers:
            self.expire()
            if len(self._entries) >= self.max_workers:
                raise RegistryFull(
                    f"{len(self._entries)} workers are registered (max_workers = {self.max_workers}); "
                    f"{worker.address} may register once one leaves"
                )
        old = self._entries.get(worker.address)
        entry = self._entries[worker.address] = _Entry(worker)
        if old is None or old.worker.instance_id != worker.instance_id:
            self.version += 1
            return False
        entry.ready, entry.probed_at = old.ready, old.probed_at  # the same process again
        if old.worker.state != worker.state:
            self.version += 1
        return True

    def heartbeat(self, worker: Worker) -> bool:
        """Refresh a known worker instance; False when it must register again (InvalidInput as `register`)."""
        _check_fields(worker)
        entry = self._entries.get(worker.address)
        if entry is None or entry.worker.instance_id != worker.instance_id:
            return False
        if entry.worker.state != worker.state:
            self.version += 1
        entry.worker, entry.last_seen = worker, time.monotonic()
        return True

    def remove(self, address: str) -> bool:
        if self._entries.pop(address, None) is None:
            return False
        self.version += 1
        return True

    def expire(self) -> list[str]:
        now = time.monotonic()
        gone = [a for a, e in self._entries.items() if now - e.last_seen > self.expiry]
        for address in gone:
            self.remove(address)
        return gone

    def workers(self) -> list[Worker]:
        return [e.worker for e in self._entries.values()]

    def routable(self) -> list[Worker]:
        """Workers whose last readiness probe passed."""
        return [e.worker for e in self._entries.values() if e.ready]

    def due_for_probe(self, *, every: float) -> list[Worker]:
        """Workers never probed, failing their probe, or last probed more than `every` s ago."""
        now = time.monotonic()
        return [e.worker for e in self._entries.values() if not e.ready or now - e.probed_at > every]

    def probed(self, worker: Worker, *, ready: bool) -> None:
        entry = self._entries.get(worker.address)
        if entry is None or entry.worker.instance_id != worker.instance_id:
            return
        entry.probed_at = time.monotonic()
        if entry.ready != ready:
            entry.ready = ready
            self.version += 1

    def suspect(self, address: str) -> None:
        """Take a worker out of routing until its next readiness probe passes (its chain stalled)."""
        entry = self._entries.get(address)
        if entry is not None and entry.ready:
            entry.ready = False
            self.version += 1

    def seconds_since(self, address: str) -> float:
        entry = self._entries.get(address)
        return time.monotonic() - entry.last_seen if entry else float("inf")

    def get(self, address: str) -> Worker | None:
        entry = self._entries.get(address)
        return entry.worker if entry else None

    def mark(self, address: str, state: str) -> None:
        entry = self._entries.get(address)
        if entry is not None and entry.worker.state != state:
            entry.worker = replace(entry.worker, state=state)
            self.version += 1


def _check_fields(worker: Worker) -> None:
    """InvalidInput naming the first text field of `worker` longer than MAX_FIELD_CHARS."""
    for f in fields(worker):
        value = getattr(worker, f.name)
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            raise InvalidInput(f"worker.{f.name}: {len(value)} characters; at most {MAX_FIELD_CHARS}")


def build_chains(
    workers: list[Worker],
    num_layers: int,
    *,
    keep: list[list[Worker]] = (),  # type: ignore[assignment]
) -> list[list[Worker]]:
    """Disjoint chains covering [0, num_layers), each of one model id.

    Chains in `keep` whose workers are all still usable come first, unchanged, so a failure
    moves only the sequences of the chain that broke. The rest are built from the remaining
    workers, fewest hops first; ties keep registration order.
    """
    usable = [w for w in workers if w.state == "SERVING"]
    chains: list[list[Worker]] = []
    alive = {(w.address, w.instance_id) for w in usable}
    for chain in keep:
        if all((w.address, w.instance_id) in alive for w in chain):
            chains.append(chain)
    taken = {w.address for chain in chains for w in chain}
    usable = [w for w in usable if w.address not in taken]
    for model_id in dict.fromkeys(w.model_id for w in usable):
        pool = [w for w in usable if w.model_id == model_id]
        while (path := _shortest_cover(pool, num_layers)) is not None:
            chains.append(path)
            used = {w.address for w in path}
            pool = [w for w in pool if w.address not in used]
    return chains


def _shortest_cover(pool: list[Worker], num_layers: int) -> list[Worker] | None:
    """Breadth-first over layer boundaries: the fewest workers whose ranges tile [0, num_layers)."""
    best: dict[int, list[Worker]] = {0: []}
    frontier = [0]
    while frontier:
        nxt: list[int] = []
        for start in frontier:
            for w in pool:
                if w.layer_start == start and w.layer_end not in best:
                    best[w.layer_end] = best[start] + [w]
                    nxt.append(w.layer_end)
        if num_layers in best:
            return best[num_layers]
        frontier = nxt
    return None
