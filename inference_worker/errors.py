"""The worker's domain errors, each naming the gRPC status code it is answered with.

Domain code raises these and never imports grpc; the server's error interceptor maps them
(loraserve/serving/errors.py). Anything else that escapes a handler is a bug: INTERNAL.
"""

from __future__ import annotations

from typing import TypeVar

from loraserve.serving.errors import ServiceError

E = TypeVar("E", bound=BaseException)


class WorkerError(ServiceError):
    """Base of the worker's expected failures."""


class InvalidRequest(WorkerError):
    code = "INVALID_ARGUMENT"


class QueueFull(WorkerError):
    code = "RESOURCE_EXHAUSTED"


class Draining(WorkerError):
    code = "UNAVAILABLE"


class NoAdapterStore(WorkerError):
    code = "FAILED_PRECONDITION"

    def __init__(self, message: str = "this worker has no adapter store configured") -> None:
        super().__init__(message)


class AdapterNotFound(WorkerError):
    code = "NOT_FOUND"


class AdapterInUse(WorkerError):
    code = "FAILED_PRECONDITION"


class AdapterMismatch(WorkerError):
    """A version (id@digest) the store no longer serves, or an adapter that does not fit this
    worker's slots (rank over max_lora_rank, another base model's shapes)."""

    code = "FAILED_PRECONDITION"


class AdapterSlotsExhausted(WorkerError):
    code = "RESOURCE_EXHAUSTED"


class AdapterCorrupt(WorkerError):
    code = "DATA_LOSS"


class DependencyUnavailable(WorkerError):
    code = "UNAVAILABLE"


class DeadlineExceeded(WorkerError):
    code = "DEADLINE_EXCEEDED"


class RankFailed(WorkerError):
    """A tensor-parallel rank died, or a collective with the other ranks failed or timed out: the
    worker can no longer compute anything, so every request ends with this and the worker exits."""

    code = "UNAVAILABLE"


def detached(exc: E) -> E:
    """`exc` itself, without its traceback, cause and context: an error kept to be handed on later
    (a sequence's failure, a failed fetch's outcome). A raised exception holds every frame it went
    through, each frame its caller's and their locals; where one of them also reaches the exception
    (the local it was caught or raised from, the sequence that keeps it), that is a reference cycle,
    and everything in those frames (a step's batch, a fetch's buffer and gRPC call) waits for the
    garbage collector instead of going when the error does."""
    exc.__traceback__ = None
    exc.__cause__ = None
    exc.__context__ = None
    return exc
