"""What each served call leaves behind: one access-log line, and (while tracing is on) a server
span continuing the caller's trace from its `traceparent` metadata.

The access line is JSON (logger `loraserve.access`, see logs.py): service, method, status, peer,
total_ms and trace_id, plus what the handler added with `access_log.note()` while serving the call (the
worker: request_id, adapter, tokens_in, tokens_out, queue_ms, ttft_ms; the store: adapter,
bytes, cache). Only the services' own methods are observed, not health checks or reflection;
the `quiet` ones (listings other services poll every few seconds) log at DEBUG, the rest at INFO.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Collection, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

import grpc

from loraserve.serving import tracing
from loraserve.serving.access_log import ACCESS_LOG, collecting
from loraserve.serving.errors import status_of
from loraserve.serving.interceptors import Continuation, _behavior_of, _handler_like

OBSERVED_PREFIX = "/loraserve."


class ObservedCallInterceptor(grpc.aio.ServerInterceptor):
    """Install first (outermost), so the status it records is the one the caller gets."""

    def __init__(self, service: str, quiet: Collection[str] = (), log: logging.Logger = ACCESS_LOG) -> None:
        self._service, self._quiet, self._log = service, frozenset(quiet), log

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OBSERVED_PREFIX):
            return handler
        method, behavior, metadata = details.method, _behavior_of(handler), details.invocation_metadata
        observe = self._observe

        if not handler.response_streaming:

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with observe(method, metadata, context):
                    return await behavior(request, context)

            return _handler_like(handler, unary_response)

        async def streamed_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with observe(method, metadata, context):
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async with aclosing(result) as messages:
                        async for message in messages:
                            yield message
                else:
                    await result

        return _handler_like(handler, streamed_response)

    @contextmanager
    def _observe(self, method: str, metadata: Any, context: grpc.aio.ServicerContext) -> Iterator[None]:
        start = time.perf_counter()
        peer = context.peer()  # now: once the call is over grpc may have freed what it reads
        code = "OK"
        parent = tracing.extract(metadata) if tracing.enabled() else None
        name = method.removeprefix("/")
        with (
            collecting() as fields,
            tracing.span(name, _rpc_attributes(name), parent=parent, server=True) as span,
        ):
            try:
                yield
                code = _code_of(context) or "OK"
            except grpc.aio.AbortError:
                code = _code_of(context) or "UNKNOWN"
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:
                code = status_of(exc)[0]
                raise
            finally:
                self._finish(method, peer, span, code, fields, start)

    def _finish(
        self,
        method: str,
        peer: str,
        span: Any,
        code: str,
        fields: dict[str, Any],
        start: float,
    ) -> None:
        if span is not None:
            numeric = grpc.StatusCode[code].value[0] if code in grpc.StatusCode.__members__ else 2
            tracing.annotate({"rpc.grpc.status_code": numeric}, span)
            if code != "OK":
                tracing.set_error(span, code)
        line = {
            "service": self._service,
            "method": method.rsplit("/", 1)[-1],
            "status": code,
            "peer": peer,
            "total_ms": round((time.perf_counter() - start) * 1e3, 3),
            **fields,
        }
        if span is not None:
            line["trace_id"] = tracing.trace_id(span)
        level = logging.DEBUG if line["method"] in self._quiet else logging.INFO
        self._log.log(level, "%s %s", line["method"], code, extra={"fields": line})


def _code_of(context: grpc.aio.ServicerContext) -> str | None:
    code = context.code()
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    by_value = {c.value[0]: c.name for c in grpc.StatusCode}
    return by_value.get(int(code), "UNKNOWN")


def _rpc_attributes(name: str) -> dict[str, str]:
    service, _, method = name.partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
