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


# Bytes of a status message as sent (grpc-message is percent-encoded: every byte outside printable
# ASCII, and '%', takes 3). A client drops a response whose trailers pass 8 KiB (soft) or 16 KiB
# (hard) with RESOURCE_EXHAUSTED, so a message that quotes a client's input (a tensor name, a
# config value) is cut well below that.
MAX_STATUS_MESSAGE_BYTES = 4096


def status_of(exc: BaseException) -> tuple[StatusName, str]:
    """(status code name, message) for an exception raised while serving a request."""
    if isinstance(exc, ServiceError):
        return exc.code, bounded_message(exc.message)
    return "INTERNAL", bounded_message(f"internal error: {type(exc).__name__}: {exc}")


def bounded_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """`message`, cut (marked with '...') where its percent-encoded form would pass `limit` bytes."""
    if len(message) * 12 <= limit:  # at most 4 UTF-8 bytes a character, 3 encoded bytes each
        return message
    size = 0
    for i, ch in enumerate(message):
        size += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "replace"))
        if size > limit - 3:
            return message[:i] + "..."
    return message
