"""The access log's per-call fields: the server's call observer (observed_calls.py) opens a
record per call, and whatever serves it adds fields with `note()`, without knowing of gRPC."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

ACCESS_LOG = logging.getLogger("loraserve.access")

_fields: ContextVar[dict[str, Any] | None] = ContextVar("loraserve_access_fields", default=None)


def note(**fields: Any) -> None:
    """Add fields to the access line of the call being served (nothing outside a call)."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


@contextmanager
def collecting() -> Iterator[dict[str, Any]]:
    """A fresh record that `note()` fills while the block runs (in this context and the tasks
    and threads it starts, which copy the context)."""
    fields: dict[str, Any] = {}
    token = _fields.set(fields)
    try:
        yield fields
    finally:
        _fields.reset(token)
