"""The error vocabulary: status codes by name, the kinds of failure, and one table between them.

Owns `Code`, gRPC's status codes as plain integers (the values gRPC uses), so that modules
without grpc (the scheduler, the engine) name a status instead of writing its number; the
domain exception bases every service raises (`InvalidInput` and its `OverLimit`, `NoCapacity`,
`Unreachable`, `Unauthenticated`, `Forbidden`); and `STATUS_OF`, the one table from those kinds to a status, read by
`status_of`. A service's own exceptions subclass one of the bases, so the table never names
them. Imports neither grpc nor torch.
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """gRPC status codes, by the values the wire carries."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, value: int) -> Code:
        """The code of a wire value; UNKNOWN for a value gRPC does not define."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class InvalidInput(ValueError):
    """What a caller sent breaks a rule of the contract: a field, a shape, a position."""


class OverLimit(InvalidInput):
    """What a caller sent is well formed but past a configured bound (a size, a count). It can never
    pass as sent, so it is INVALID_ARGUMENT (gRPC's RESOURCE_EXHAUSTED would invite a retry)."""


class NoCapacity(RuntimeError):
    """This process has no room for the work now (a full KV cache, a full queue); it may fit later."""


class Unreachable(RuntimeError):
    """A peer or a part of this process cannot serve (a dead hop, a failed rank): move the work."""


class Unauthenticated(PermissionError):
    """The caller did not prove who it is (no token, a wrong one)."""


class Forbidden(PermissionError):
    """The caller is known, but its role may not do this."""


# Kinds of failure -> the status a caller sees. An exception takes the entry of the first class
# of its MRO found here.
STATUS_OF: dict[type[Exception], Code] = {
    InvalidInput: Code.INVALID_ARGUMENT,
    NoCapacity: Code.RESOURCE_EXHAUSTED,
    Unreachable: Code.UNAVAILABLE,
    Unauthenticated: Code.UNAUTHENTICATED,
    Forbidden: Code.PERMISSION_DENIED,
}


def status_of(err: BaseException) -> Code:
    """The status `err` answers with; INTERNAL for anything that is not a known kind (a defect)."""
    for kind in type(err).__mro__:
        code = STATUS_OF.get(kind)
        if code is not None:
            return code
    return Code.INTERNAL
