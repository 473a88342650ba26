"""The server interceptors both services install: bearer-token checks per method, and domain
errors turned into statuses in one place, for unary and streaming RPCs alike.

Servicers stay thin: they raise `ServiceError`s (loraserve/serving/errors.py) and never build a
status or check a token themselves.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import grpc

from loraserve.serving.bearer import check_bearer
from loraserve.serving.errors import ServiceError, status_of

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def _handler_like(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary/streaming each way) and (de)serializers running `behavior`."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`tokens` maps full method names (/pkg.Service/Method) to the token they require, or to
    the tokens any one of which they accept; methods not named, or named with no non-empty
    token, are open. No `authorization` metadata -> UNAUTHENTICATED; another token ->
    PERMISSION_DENIED (compared in constant time)."""

    def __init__(self, tokens: Mapping[str, str | Sequence[str | None] | None]) -> None:
        accepted = {
            method: tuple(t for t in ((token,) if isinstance(token, str) or token is None else token) if t)
            for method, token in tokens.items()
        }
        self._tokens = {method: ts for method, ts in accepted.items() if ts}

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        token = self._tokens.get(details.method)
        if handler is None or token is None:
            return handler
        denied = check_bearer(details.invocation_metadata, token, details.method)
        if denied is None:
            return handler
        code, message = grpc.StatusCode[denied[0]], denied[1]

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        return _handler_like(handler, refuse)


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Answers a `ServiceError` escaping a handler with its status and message (logged at INFO),
    anything else with INTERNAL (logged with its traceback). A status the handler set itself
    (context.abort) and cancellation pass through untouched."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method, behavior = details.method, _behavior_of(handler)

        if not handler.response_streaming:

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await self._abort(context, exc, method)

            return _handler_like(handler, unary_response)

        async def streamed_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async with aclosing(result) as messages:
                        async for message in messages:
                            yield message
                else:  # a handler that writes its messages with context.write
                    await result
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._abort(context, exc, method)

        return _handler_like(handler, streamed_response)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
        code, message = status_of(exc)
        if isinstance(exc, ServiceError):
            self._log.info("%s -> %s: %s", method, code, message)
        else:
            self._log.error("%s failed unexpectedly", method, exc_info=exc)
        await context.abort(grpc.StatusCode[code], message)
