"""Domain errors of the adapter store, each naming the gRPC status code it is answered with.

Domain modules raise these and never import grpc; the server's error interceptor maps them
(loraserve/serving/errors.py). Anything that is not a ServiceError is a bug and becomes INTERNAL.
"""

from __future__ import annotations

from loraserve.serving.errors import ServiceError


class StoreError(ServiceError):
    """Base of the store's expected failures."""


class InvalidArgument(StoreError):
    """Malformed id or source, bad shape/dtype, rank over the limit, corrupt checkpoint."""

    code = "INVALID_ARGUMENT"


class NotFound(StoreError):
    """Unknown adapter, missing source file or S3 key."""

    code = "NOT_FOUND"


class AlreadyExists(StoreError):
    """Adapter id taken by another registration (another source or record) and overwrite not requested."""

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


class PayloadDamaged(DataLoss):
    """Bytes a fetch had already streamed came from a damaged copy of the payload (the store has
    removed it): the fetch must start again from offset 0, and then gets a rebuilt payload. The
    servicer marks the status with the trailing metadata key REFETCH_KEY."""
