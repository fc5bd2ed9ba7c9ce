"""Routes the coordinator issues and stages follow: their tags, and what an address may be.

Owns the route tag, an HMAC-SHA256 under the coordinator's key (handed to each stage when it
registers) of a step's model id and whole chain of stage addresses, and the rule for an address
a stage may open a stream to (`HOST:PORT`, nothing else: no `unix:` path, no scheme). The
coordinator tags each step it sends; a stage that holds the key follows a step only if its tag is
good. Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence

from .errors import Forbidden, InvalidInput

KEY_BYTES = 32
MAX_ADDRESS_BYTES = 262  # a DNS name (253) and a port
_ADDRESS = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")


def new_key() -> bytes:
    """A fresh route key (one per coordinator process)."""
    return secrets.token_bytes(KEY_BYTES)


def route_tag(key: bytes, model_id: str, chain: Sequence[str]) -> bytes:
    """The tag of `chain` (every stage's address, first first) for a step of `model_id`."""
    message = b"\0".join([model_id.encode(), *(address.encode() for address in chain)])
    return hmac.new(key, message, hashlib.sha256).digest()


def check_tag(key: bytes, model_id: str, chain: Sequence[str], tag: bytes) -> None:
    """Forbidden unless `tag` is the coordinator's tag of this chain (compared in constant time)."""
    if not hmac.compare_digest(route_tag(key, model_id, chain), tag):
        raise Forbidden("route_tag does not match the chain: this stage follows only routes its coordinator issued")


def check_address(address: str, *, field: str = "route") -> None:
    """InvalidInput unless `address` is `HOST:PORT` with a port in 1..65535."""
    match = _ADDRESS.match(address) if len(address) <= MAX_ADDRESS_BYTES else None
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise InvalidInput(f"{field} address {address[:64]!r} is not HOST:PORT")
