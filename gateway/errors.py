"""OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) and the one mapping from
the workers' and the store's gRPC status codes to HTTP status codes."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from loraserve.gateway.schemas import ErrorBody, ErrorResponse

log = logging.getLogger("loraserve.gateway")

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
HTTP_OF_STATUS: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    # Generate's: an adapter version the store no longer serves or this worker cannot hold, an
    # adapter asked of a worker with no store
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "model_not_available"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "unauthenticated"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error", "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
}
INTERNAL = (500, "server_error", "internal_error")

# The request field a worker's INVALID_ARGUMENT is about, read from its message (the status names
# none): (pattern, param, code), the first match wins; a message none matches leaves param null.
# A param in the worker's terms; `APIError.from_rpc` renames it to the request's (chat: messages).
_WORKER_PARAMS: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(pattern), param, code)
    for pattern, param, code in (
        (r"prompt (\(\d+ tokens\) )?plus max_tokens", "max_tokens", "context_length_exceeded"),
        (r"prompt \(\d+ tokens\) leaves no room", "prompt", "context_length_exceeded"),
        (r"(the )?prompt\b", "prompt", "invalid_value"),
        (r"(messages)\[(\d+)\]\.(\w+)", r"\1.\2.\3", "invalid_value"),
        (r"(the model's chat template .* the )?messages\b", "messages", "invalid_value"),
        (r"(n|temperature|top_p|top_k|top_logprobs|\w+_penalty) must\b", r"\1", "invalid_value"),
        (r"(send at most \d+|a) stop string", "stop", "invalid_value"),
        (r"adapter (id|digest) ", "model", "invalid_value"),
    )
)


def worker_param(message: str) -> tuple[str | None, str]:
    """(param, code) of a worker's INVALID_ARGUMENT message."""
    for pattern, param, code in _WORKER_PARAMS:
        found = pattern.match(message)
        if found:
            return found.expand(param), code
    return None, "invalid_value"


class APIError(Exception):
    """A request's failure as OpenAI reports it: `code` is OpenAI's short name of the failure
    (model_not_found, invalid_value, ...) or None, never the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, names: Mapping[str, str] | None = None) -> APIError:
        """The worker's status as OpenAI's error; `names` renames the worker's fields to the ones
        the request set (max_tokens -> max_completion_tokens, prompt -> messages)."""
        code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
        message = exc.details() or code.name  # type: ignore[attr-defined]
        status, kind, name = HTTP_OF_STATUS.get(code, INTERNAL)
        param = None
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
            param = "model"  # Generate's: about the adapter (version) the model names
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            param, name = worker_param(message)
            if param is not None and names:
                head, dot, rest = param.partition(".")
                param = names.get(head, head) + dot + rest
        return cls(status, message, kind, param, name)

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def unknown_model(model: str, why: str = "") -> APIError:
    message = f"the model {model!r} does not exist" + (f": {why}" if why else "")
    return APIError(404, message, "not_found_error", "model", "model_not_found")


# pydantic puts the union member a value failed in into the error's loc ('str', 'list[TextPart]',
# 'constrained-str'); no field of the API is named like one
_UNION_MEMBER = re.compile(r"str|int|float|bool|[a-z]+-[a-z]+|\w+\[.*\]|[A-Z]\w*")
_JSON_OBJECT = "send a JSON object with Content-Type: application/json"
Loc = tuple[int | str, ...]


def _is_member(part: int | str) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None


def _reach(loc: Loc) -> tuple[int, ...]:
    """How far into the value a failure at `loc` got: its list indices (a key counts as 0), compared
    as tuples: a later element, else a deeper one, is further."""
    return tuple(p if isinstance(p, int) else 0 for p in loc if not _is_member(p))


def _meant(errors: Sequence[Mapping], start: int = 0) -> Mapping:
    """The error of the first problem, in the union member the client meant. A value no member of a
    union accepts fails in each member; the member that got furthest into the value before its first
    failure is the one meant (["a", 3] is a list of strings with a bad element 1, not token ids
    with a bad element 0; a list of parts with a bad part, not a string); a tie goes to the first
    member. A union inside the chosen member is decided the same way."""
    loc: Loc = tuple(errors[0].get("loc", ()))
    at = next((i for i in range(start, len(loc)) if _is_member(loc[i])), None)
    if at is None:
        return errors[0]
    firsts: dict[int | str, Mapping] = {}  # each member's first failure
    for e in errors:
        where: Loc = tuple(e.get("loc", ()))
        if len(where) > at and where[:at] == loc[:at] and _is_member(where[at]):
            firsts.setdefault(where[at], e)
    member = max(firsts, key=lambda m: _reach(tuple(firsts[m]["loc"])[at + 1 :]))
    inside = [e for e in errors if tuple(e.get("loc", ()))[: at + 1] == (*loc[:at], member)]
    return _meant(inside, at + 1)


def _code_of(error: Mapping) -> str:
    """OpenAI's code for a pydantic error: a field left out, a value of the wrong JSON type, or one
    out of range (or not among the allowed)."""
    kind = str(error.get("type", ""))
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith(("_type", "_parsing")) or kind == "int_from_float":
        return "invalid_type"
    return "invalid_value"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """The first problem (in the union member the client meant), naming its field as a dotted path
    (`messages.0.role`), and its code."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_value"
    first = errors[0]
    loc = list(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        where = f" (at character {loc[-1]})" if len(loc) > 1 else ""
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}{where}",
            None,
            "invalid_json",
        )
    if loc[:1] == ["body"] and len(loc) == 1:
        if first.get("type") == "missing":
            return f"the request body is empty: {_JSON_OBJECT}", None, "invalid_json"
        return f"the request body must be a JSON object: {_JSON_OBJECT}", None, "invalid_json"
    first = _meant(errors)
    path = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_member(p)]
    field = ".".join(path) or None
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return message, field, _code_of(first)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, field, code = _validation_message(exc)
        return APIError(400, message, param=field, code=code).response()

    @app.exception_handler(grpc.RpcError)
    async def _rpc(request: Request, exc: grpc.RpcError) -> JSONResponse:
        return APIError.from_rpc(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        status, kind, code = INTERNAL
        return APIError(status, f"internal error: {type(exc).__name__}", kind, code=code).response()
