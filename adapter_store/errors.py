"""Domain errors of the adapter store and the one place that maps them to gRPC status codes.

Domain modules raise these classes and never import grpc; the servicer turns them into a status
with `status_of`. Anything that is not a StoreError is a bug and becomes INTERNAL.
"""

from __future__ import annotations

from typing import Any


class StoreError(Exception):
    """Base class; `code` is the name of the gRPC status code it maps to."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(StoreError):
    """Malformed id or source, bad shape/dtype, rank over the limit, corrupt checkpoint."""

    code = "INVALID_ARGUMENT"


class NotFound(StoreError):
    """Unknown adapter, missing source file or S3 key."""

    code = "NOT_FOUND"


class AlreadyExists(StoreError):
    """Adapter id taken and overwrite not requested."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(StoreError):
    """Another base model, an unsupported target module or PEFT method, a stale digest."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(StoreError):
    """A bounded queue or budget is full."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(StoreError):
    """The store is draining or a dependency (S3, Redis) cannot be reached."""

    code = "UNAVAILABLE"


class DataLoss(StoreError):
    """The optimized payload no longer matches the registered digest."""

    code = "DATA_LOSS"


def status_of(exc: BaseException) -> tuple[Any, str]:
    """(grpc.StatusCode, message) for an exception raised while serving a request."""
    import grpc

    if isinstance(exc, StoreError):
        return getattr(grpc.StatusCode, exc.code), exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
