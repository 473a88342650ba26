"""OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) and the one mapping from
the workers' and the store's gRPC status codes to HTTP status codes."""

from __future__ import annotations

import logging
import re

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from loraserve.gateway.schemas import ErrorBody, ErrorResponse

log = logging.getLogger("loraserve.gateway")

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_OF_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
}


class APIError(Exception):
    """A request's failure as OpenAI reports it."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> APIError:
        code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
        status, kind = HTTP_OF_STATUS.get(code, (500, "server_error"))
        return cls(status, exc.details() or code.name, kind)  # type: ignore[attr-defined]

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=str(self.status))
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def unknown_model(model: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist", "not_found_error", "model")


# pydantic puts the union member a value failed in into the error's loc ('str', 'list[TextPart]',
# 'constrained-str'); no field of the API is named like one
_UNION_MEMBER = re.compile(r"str|int|float|bool|[a-z]+-[a-z]+|\w+\[.*\]|[A-Z]\w*")
_JSON_OBJECT = "send a JSON object with Content-Type: application/json"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem, naming its field as a dotted path (`messages.0.role`). A value that no
    member of a union accepts fails once per member; the member that got deepest into the value is
    the one the client meant (a list of parts with a bad part, not a string)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        where = f" (at character {loc[-1]})" if len(loc) > 1 else ""
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}{where}", None
    if loc[:1] == ["body"] and len(loc) == 1:
        if first.get("type") == "missing":
            return f"the request body is empty: {_JSON_OBJECT}", None
        return f"the request body must be a JSON object: {_JSON_OBJECT}", None
    same_field = [e for e in errors if list(e.get("loc", ()))[:2] == loc[:2]]
    first = max(same_field, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
    path = [
        str(p)
        for p in first.get("loc", ())
        if p != "body" and not (isinstance(p, str) and _UNION_MEMBER.fullmatch(p))
    ]
    field = ".".join(path) or None
    return (f"{field}: {first.get('msg')}" if field else str(first.get("msg"))), field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return APIError(400, message, param=field).response()

    @app.exception_handler(grpc.RpcError)
    async def _rpc(request: Request, exc: grpc.RpcError) -> JSONResponse:
        return APIError.from_rpc(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()
