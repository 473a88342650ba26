"""Bearer-token check of the admin RPCs, as a server interceptor.

No `authorization` metadata -> UNAUTHENTICATED; a token that differs -> PERMISSION_DENIED.
Tokens are compared in constant time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import grpc

from clients.bearer import check_bearer

ADMIN_METHODS = ("/loraserve.v1.AdapterStore/RegisterAdapter", "/loraserve.v1.AdapterStore/DeleteAdapter")


def _denied(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, methods: Iterable[str] = ADMIN_METHODS) -> None:
        self._token = token
        self._methods = frozenset(methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in self._methods:
            denied = check_bearer(details.invocation_metadata, self._token, details.method)
            if denied is not None:
                code, message = denied
                return _denied(grpc.StatusCode[code], message)
        return await continuation(details)
