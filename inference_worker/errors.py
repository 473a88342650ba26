"""The worker's domain errors and, in one place, the gRPC status code each maps to.

Domain code raises these (it never imports grpc); the servicer turns them into statuses with
`status_code_name`/`grpc_status_code`. Anything else that escapes is a bug: INTERNAL.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of the worker's expected failures."""

    code = "INTERNAL"


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


def status_code_name(exc: BaseException) -> str:
    """The gRPC status code name for an exception (INTERNAL for anything unexpected)."""
    if isinstance(exc, WorkerError):
        return exc.code
    from inference_worker.model.config import ModelConfigError

    if isinstance(exc, ModelConfigError):
        return "FAILED_PRECONDITION"
    return "INTERNAL"


def grpc_status_code(exc: BaseException):
    import grpc

    return getattr(grpc.StatusCode, status_code_name(exc))
