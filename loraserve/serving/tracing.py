"""OpenTelemetry tracing of the services: spans, and W3C trace context (`traceparent`) carried in
gRPC metadata from one service to the next.

Off by default, at no cost: until `enable` (or `enable_otlp`) installs a tracer provider,
opentelemetry is not imported, `span` hands back one shared no-op context manager, `record_span`
and `annotate` return at once, and servers and channels get no tracing interceptor. The
provider is this module's own, not OpenTelemetry's global one, so tests can swap it.

Span names: `<service>.<step>` (worker.queue, worker.prefill, worker.decode, worker.adapter_load,
store.fetch, store.build); the gRPC spans are named `<package>.<Service>/<Method>` as the
OpenTelemetry RPC conventions say. Attributes of our own are under `loraserve.`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import grpc

AttributeValue = str | bool | int | float
Attributes = Mapping[str, AttributeValue]

_NOOP: AbstractContextManager[Any] = nullcontext(None)
_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def enable(provider: Any) -> None:
    """Trace from now on through `provider` (an opentelemetry.sdk TracerProvider)."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("loraserve")


def disable() -> None:
    """Stop tracing; spans still buffered are flushed and the provider shut down."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


def enable_otlp(endpoint: str, service_name: str) -> None:
    """Export spans over OTLP/gRPC to `endpoint` (e.g. http://collector:4317), batched off the
    request path. The exporter is the `otlp` extra; without it this raises ValueError."""
    if enabled():
        return  # several services of one process (`loraserve up`) share one provider
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ValueError("--otlp-endpoint needs the OTLP exporter: pip install 'loraserve[otlp]'") from exc
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    enable(provider)


# ---------------------------------------------------------------------------------------- spans
def span(
    name: str, attributes: Attributes | None = None, *, parent: Any = None, server: bool = False
) -> AbstractContextManager[Any]:
    """A span, current inside the `with`, child of `parent` (a context from `current_context` or
    `extract`) or of the current span; `server` marks the span of an RPC served. The block gets
    the span, or None while tracing is off."""
    if _tracer is None:
        return _NOOP
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes, kind=kind)


def record_span(
    name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None, *, parent: Any = None
) -> None:
    """A span of something already over (its times measured by other means), e.g. the queue wait
    of a request that the engine timed on its own thread. Times are time.time_ns() values."""
    if _tracer is None:
        return
    s = _tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    s.end(end_time=max(start_ns, end_ns))


def annotate(attributes: Attributes, target: Any = None) -> None:
    """Set attributes on `target` (a span) or on the current span."""
    if _tracer is None:
        return
    if target is None:
        from opentelemetry import trace

        target = trace.get_current_span()
    target.set_attributes(dict(attributes))


def set_error(target: Any, description: str) -> None:
    """Mark `target` (a span) as failed."""
    if target is None:
        return
    from opentelemetry.trace import Status, StatusCode

    target.set_status(Status(StatusCode.ERROR, description))


def trace_id(target: Any) -> str:
    """The 32-hex trace id of `target` (a span), "" for none."""
    if target is None:
        return ""
    ctx = target.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else ""


def current_context() -> Any:
    """The current trace context, to parent spans made later or on another thread; None while off."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def attached(ctx: Any) -> AbstractContextManager[Any]:
    """Make `ctx` (from current_context) the current context inside the `with`, on this thread."""
    if ctx is None or _tracer is None:
        return _NOOP
    return _attach(ctx)


@contextmanager
def _attach(ctx: Any) -> Iterator[None]:
    from opentelemetry import context

    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def wall_ns(monotonic_s: float) -> int:
    """time.time_ns() of a past time.monotonic() reading (span times are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


# ----------------------------------------------------------------------------------- propagation
def inject(metadata: Sequence[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """`metadata` plus the current span's `traceparent` (and `tracestate`) entries."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return [*(metadata or ()), *carrier.items()]


def extract(metadata: Sequence[tuple[str, str | bytes]] | None) -> Any:
    """The remote parent context the caller's `traceparent` names (an empty context without one)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {k: v for k, v in metadata or () if isinstance(v, str) and k in ("traceparent", "tracestate")}
    return TraceContextTextMapPropagator().extract(carrier)


class UnaryTraceContextInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the current span's `traceparent` to the metadata of each unary call, so the service
    called continues the caller's trace."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_trace_context(client_call_details), request)


class StreamTraceContextInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (grpc.aio takes one kind of call per interceptor)."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_trace_context(client_call_details), request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors a grpc.aio channel opened now needs: trace propagation while tracing is on."""
    return [UnaryTraceContextInterceptor(), StreamTraceContextInterceptor()] if enabled() else []


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = inject(list(details.metadata or ()))
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*metadata),
        details.credentials,
        details.wait_for_ready,
    )
