"""The FastAPI application: the routes of the OpenAI-compatible API (/v1/models, /v1/completions,
/v1/chat/completions), the API key check, /health and Prometheus /metrics. Requests are handled by
`RequestHandler.handle`; this module only wires them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve import __version__
from loraserve.gateway.backend import Backend
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.errors import APIError, install_error_handlers, unknown_model
from loraserve.gateway.handler import RequestHandler
from loraserve.gateway.limits import BodyLimit
from loraserve.gateway.metrics import GatewayMetrics
from loraserve.gateway.requests import adapter_for
from loraserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, Model, ModelList
from loraserve.serving import tracing
from loraserve.serving.bearer import check_bearer

_AUTH_STATUS = {
    "UNAUTHENTICATED": (401, "authentication_error", "missing_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", "invalid_api_key"),
}
# a route's own HTTP errors (no such path, a method it does not take)
_HTTP_CODES = {404: "unknown_url", 405: "method_not_allowed"}


def _adapter_model(info, base: str) -> Model:
    return Model(
        id=info.adapter_id,
        created=int(info.created_at.seconds) if info.HasField("created_at") else 0,
        root=info.adapter_id,
        parent=base,
    )


def create_app(config: GatewayConfig, backend: Backend | None = None) -> FastAPI:
    if config.otlp_endpoint:
        tracing.enable_otlp(config.otlp_endpoint, "loraserve-gateway")
    backend = backend or Backend(config)
    metrics = GatewayMetrics()
    handler = RequestHandler(config, backend, metrics)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend.start()  # the fleet's first read before the first request where it can
        yield
        await backend.close()

    app = FastAPI(title="loraserve OpenAI-compatible API", version=__version__, lifespan=lifespan)
    app.state.backend, app.state.metrics, app.state.handler = backend, metrics, handler
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), code=_HTTP_CODES.get(exc.status_code)).response()

    def api_key(request: Request) -> None:
        """Bearer API key of /v1/*: 401 without one, 403 for a wrong one; open without --api-key."""
        if not config.api_key:
            return
        header = request.headers.get("authorization")
        problem = check_bearer([("authorization", header)] if header else [], config.api_key)
        if problem is not None:
            status, kind, code = _AUTH_STATUS[problem[0]]
            message = (
                "missing API key: send 'Authorization: Bearer <key>'" if status == 401 else "invalid API key"
            )
            raise APIError(status, message, kind, code=code)

    v1 = [Depends(api_key)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def list_models() -> ModelList:
        base = await backend.base_model()
        adapters = await backend.adapters()
        return ModelList(
            data=[Model(id=base, created=started, root=base), *(_adapter_model(a, base) for a in adapters)]
        )

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def get_model(model: str) -> Model:
        """The base model, or an adapter the store holds; `id@digest` only while the store serves
        that version (the one a generation naming it gets)."""
        base = await backend.base_model()
        if not adapter_for(model, base):
            return Model(id=base, created=started, root=base)
        adapter_id, at, digest = model.partition("@")
        if backend.store is not None:
            try:
                info = await backend.store.get(adapter_id)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    raise
            else:
                if not at:
                    return _adapter_model(info, base)
                if digest == info.digest:
                    return _adapter_model(info, base).model_copy(update={"id": model})
                raise unknown_model(model, f"the store serves adapter {adapter_id!r} at another digest")
        raise unknown_model(model)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handler.handle(request, "completions", body)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await handler.handle(request, "chat.completions", body)

    return app
