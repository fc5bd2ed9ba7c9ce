"""Which member of a cluster may call what.

With mutual TLS on, every caller of a member's port presents a certificate from the cluster's CA
whose common name is its role (`coordinator`, `stage`, `client`); `require` refuses a call whose
role may not do the action, with `Forbidden` (PERMISSION_DENIED) naming both. With TLS off the
network is trusted and every call is allowed. Knows nothing of the services themselves.
"""

from __future__ import annotations

from collections.abc import Collection

from .errors import Forbidden
from .tls import HasAuthContext, peer_role

COORDINATOR, STAGE, CLIENT = "coordinator", "stage", "client"


def require(context: HasAuthContext, allowed: Collection[str], *, tls: bool, action: str) -> str | None:
    """The caller's role when it may do `action` (None with TLS off); Forbidden otherwise."""
    if not tls:
        return None
    role = peer_role(context)
    if role not in allowed:
        roles = " or the ".join(sorted(allowed))
        raise Forbidden(f"{action} is for the {roles}; this caller's certificate is {role or 'not a member'}'s")
    return role
