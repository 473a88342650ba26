"""Tracing is off at no cost until configured, and exports over OTLP when it is."""

from __future__ import annotations

import subprocess
import sys

from loraserve.adapter_store.config import StoreConfig
from loraserve.inference_worker.config import WorkerConfig
from loraserve.serving import tracing


def test_off_by_default_no_spans_no_interceptors() -> None:
    assert not tracing.enabled()
    assert tracing.span("a") is tracing.span("b", {"k": 1})  # one shared no-op context manager
    with tracing.span("a") as span:
        assert span is None
    tracing.record_span("x", 0, 1)
    tracing.annotate({"k": "v"})
    assert tracing.current_context() is None and tracing.client_interceptors() == []


def test_serving_without_tracing_never_imports_opentelemetry() -> None:
    code = (
        "import sys\n"
        "import loraserve.adapter_store.server, loraserve.inference_worker.server\n"
        "from loraserve.serving import tracing\n"
        "with tracing.span('x'):\n"
        "    tracing.annotate({'k': 1})\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_otlp_endpoint_flag_and_variable() -> None:
    assert StoreConfig.from_args(["--base-model", "m", "--otlp-endpoint", "http://c:4317"]).otlp_endpoint == (
        "http://c:4317"
    )
    env = {"LORASERVE_OTLP_ENDPOINT": "http://collector:4317"}
    assert WorkerConfig.from_args(["--model", "m"], env).otlp_endpoint == "http://collector:4317"
    assert WorkerConfig(model="m").otlp_endpoint == ""  # off


def test_enable_otlp_batches_spans_to_the_exporter() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        tracing.enable_otlp("http://127.0.0.1:9", "loraserve-test")
        assert tracing.enabled() and len(tracing.client_interceptors()) == 2
        provider = tracing._provider
        assert provider.resource.attributes["service.name"] == "loraserve-test"
        (processor,) = provider._active_span_processor._span_processors
        assert isinstance(processor, BatchSpanProcessor)
        assert isinstance(processor._batch_processor._exporter, OTLPSpanExporter)
    finally:
        tracing.disable()
    assert not tracing.enabled()


def test_trace_context_round_trips_through_metadata(spans) -> None:
    with tracing.span("caller") as caller:
        metadata = tracing.inject([("authorization", "Bearer t")])
    assert metadata[0] == ("authorization", "Bearer t")
    parent = tracing.extract(metadata)
    with tracing.span("callee", parent=parent, server=True) as callee:
        pass
    assert callee.context.trace_id == caller.context.trace_id
    assert callee.parent.span_id == caller.context.span_id and callee.parent.is_remote
    assert tracing.trace_id(callee) == f"{caller.context.trace_id:032x}"
