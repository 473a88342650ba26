"""Tracing on for one test, into an in-memory exporter (a pytest plugin of the root conftest)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def spans() -> Iterator[Any]:
    """An InMemorySpanExporter receiving every span ended while the test runs."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loraserve.serving import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    yield exporter
    tracing.disable()


def wait_for_spans(exporter: Any, done: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
    """The finished spans once `done(spans)` holds (server spans end just after the answer)."""
    deadline = time.monotonic() + timeout
    while True:
        finished = list(exporter.get_finished_spans())
        if done(finished) or time.monotonic() > deadline:
            return finished
        time.sleep(0.02)
