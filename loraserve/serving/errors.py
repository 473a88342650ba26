"""The root of both services' domain errors and the one mapping from an exception to a status.

Each service's `errors.py` derives its exceptions from `ServiceError` and names the gRPC status
code each maps to; domain code raises them and never imports grpc. The servers' error interceptor
(loraserve/serving/interceptors.py) turns them into statuses with `status_of`; anything else that
escapes a handler is a bug and becomes INTERNAL, never UNKNOWN.
"""

from __future__ import annotations

from typing import ClassVar, Literal

# the gRPC status codes a domain error may map to (names of grpc.StatusCode)
StatusName = Literal[
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "DATA_LOSS",
    "INTERNAL",
]


class ServiceError(Exception):
    """An expected failure of a request; `code` is the status it is answered with, the message
    (str of the exception) its details."""

    code: ClassVar[StatusName] = "INTERNAL"

    @property
    def message(self) -> str:
        return str(self)


def status_of(exc: BaseException) -> tuple[StatusName, str]:
    """(status code name, message) for an exception raised while serving a request."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    return "INTERNAL", f"internal error: {type(exc).__name__}: {exc}"
