"""Which steps a stage follows: routes its coordinator issued, through this stage.

Owns the check of a step's route before the stage computes it. A stage that registered holds its
coordinator's route key (`RegisterResponse.route_key`); it then follows a step only if the
step's `route_tag` is the key's tag of its `chain` and model id, this stage is in the chain with
`route` exactly the hops after it, and the sender may start there (the coordinator at the first
stage; a stage further on; with TLS off, the sender's role is unknown and not checked). A stage
with no coordinator (started alone, for tests and tools) follows any route of `HOST:PORT`
addresses. The chain a step came by names the sequences it starts (see `StageEngine.run`). A
route followed once is remembered whole (every field the check reads, the sender and this stage's
address), so the next step by it is not checked again; a new key forgets them all.
Knows nothing of gRPC, tensors or the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from layerline.protos.v1 import stage_pb2
from layerline.shared.access import COORDINATOR, STAGE
from layerline.shared.errors import Forbidden, OverLimit
from layerline.shared.routes import check_address, check_tag

MAX_HOPS = 64  # stages in one chain
MAX_FOLLOWED = 256  # routes remembered as followed (a stage sees a few chains, each of a few routes)


class RouteGuard:
    """The route key this stage got from its coordinator, and the check of each step's route."""

    def __init__(self, *, address: Callable[[], str]) -> None:
        self.address = address  # this stage's advertised address, as chains name it
        self._key: bytes | None = None
        # The routes followed lately, whole (model id, chain, route, tag, sender, this stage's
        # address): the same route again is the same answer under the same key.
        self._followed: dict[tuple[object, ...], str] = {}

    @property
    def key(self) -> bytes | None:
        """The coordinator's route key, set when the stage registers; None: no coordinator."""
        return self._key

    @key.setter
    def key(self, key: bytes | None) -> None:
        self._key = key
        self._followed.clear()

    def check(self, header: stage_pb2.StepHeader, *, sender: str | None) -> str:
        """The chain the step came by ("" without a key); Forbidden or InvalidInput if it may not be followed."""
        if len(header.chain) > MAX_HOPS or len(header.route) > MAX_HOPS:
            raise OverLimit(f"chain holds {len(header.chain)} and route {len(header.route)} hops: at most {MAX_HOPS}")
        route = (header.model_id, tuple(header.chain), tuple(header.route), header.route_tag, sender, self.address())
        chain = self._followed.get(route)
        if chain is None:
            chain = self._check(header, sender=sender)
            if len(self._followed) >= MAX_FOLLOWED:
                self._followed.clear()
            self._followed[route] = chain
        return chain

    def _check(self, header: stage_pb2.StepHeader, *, sender: str | None) -> str:
        for address in header.route:
            check_address(address)
        if self.key is None:
            return ""
        chain = list(header.chain)
        check_tag(self.key, header.model_id, chain, header.route_tag)
        me = self.address()
        if me not in chain:
            raise Forbidden(f"this stage ({me}) is not in the step's chain")
        hop = chain.index(me)
        if list(header.route) != chain[hop + 1 :]:
            raise Forbidden("route must be the hops of the chain after this stage")
        if sender == COORDINATOR and hop != 0:
            raise Forbidden(f"the coordinator starts steps at a chain's first stage, not at hop {hop}")
        if sender == STAGE and hop == 0:
            raise Forbidden("a stage sends a step only to the next hop of its chain, not to a first stage")
        return "\0".join(chain)
