"""One request of the HTTP API from arrival to its last byte: `RequestHandler.handle` turns the
request into a worker call, answers it whole or as server-sent events, maps failures to OpenAI's
error shape and records the request's metrics. Everything a request does starts and ends in
`handle`, the one place to wrap a request in a trace span.

A client that goes away cancels its generation: a stream through Starlette's disconnect watch
(the response task is cancelled, closing the worker call) once it answers, before that (its first
token not there yet: queued, a long prefill) and a whole response through the watch below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Literal, TypeVar

import grpc
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from loraserve.clients.worker_messages import Delta
from loraserve.gateway.backend import Backend
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.errors import APIError
from loraserve.gateway.metrics import GatewayMetrics
from loraserve.gateway.requests import Plan, chat_plan, completion_plan
from loraserve.gateway.responses import ChatChunks, CompletionChunks, chat_completion, completion
from loraserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.serving import tracing
from loraserve.serving.access_log import ACCESS_LOG

log = logging.getLogger("loraserve.gateway")
Endpoint = Literal["completions", "chat.completions"]
DONE = format_sse_event(data_str="[DONE]")
CLIENT_CLOSED = 499  # the status recorded for a client that went away (nginx's convention)
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


async def _disconnected(request: Request) -> None:
    """Returns once the client closes the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(model: BaseModel) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


class RequestHandler:
    def __init__(self, config: GatewayConfig, backend: Backend, metrics: GatewayMetrics) -> None:
        self.config, self.backend, self.metrics = config, backend, metrics

    async def handle(
        self, request: Request, endpoint: Endpoint, body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        """The request in a server span continuing the caller's `traceparent` header (while tracing
        is on); the worker calls it makes carry it on. A stream's span ends at its first token."""
        parent = tracing.extract(list(request.headers.items())) if tracing.enabled() else None
        attributes = {"http.request.method": "POST", "http.route": f"/v1/{endpoint.replace('.', '/')}"}
        with tracing.span(f"POST {attributes['http.route']}", attributes, parent=parent, server=True) as span:
            response = await self._handle(request, endpoint, body)
            tracing.annotate({"http.response.status_code": response.status_code}, span)
            if response.status_code >= 500:
                tracing.set_error(span, str(response.status_code))
            return response

    async def _handle(
        self, request: Request, endpoint: Endpoint, body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        start = time.perf_counter()
        status = 200
        self.metrics.in_flight.inc()
        streaming = False
        client = request.client
        line: dict = {"model": body.model, "stream": bool(body.stream)}
        line["peer"] = f"{client.host}:{client.port}" if client is not None else ""
        plan: Plan | None = None
        try:
            base = await self.backend.base_model()
            plan = (
                completion_plan(body, self.config, base)
                if isinstance(body, CompletionRequest)
                else chat_plan(body, self.config, base)
            )
            if plan.stream:
                response = await self._stream(request, plan, endpoint, start, line)
                streaming = True  # the stream's own end records it
                return response
            gen = await self._unless_disconnected(
                request, self.backend.generate(plan.adapter_id, **plan.kwargs)
            )
            self.metrics.tokens.inc(gen.usage.completion_tokens)
            line.update(tokens_in=gen.usage.prompt_tokens, tokens_out=gen.usage.completion_tokens)
            out = completion(plan, gen) if endpoint == "completions" else chat_completion(plan, gen)
            return JSONResponse(out.model_dump())
        except grpc.RpcError as exc:
            error = APIError.from_rpc(exc, plan.names if plan is not None else None)
            status = error.status
            return error.response()
        except APIError as error:
            status = error.status
            return error.response()
        except ClientGone:
            status = CLIENT_CLOSED
            self.metrics.disconnects.inc()
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not streaming:
                self._done(endpoint, status, start, line)

    def _done(self, endpoint: Endpoint, status: int, start: float, line: dict) -> None:
        seconds = time.perf_counter() - start
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(seconds)
        fields = {
            "service": "gateway",
            "method": endpoint,
            "status": status,
            "total_ms": round(seconds * 1e3, 3),
        }
        ACCESS_LOG.info("%s %s", endpoint, status, extra={"fields": {**fields, **line}})

    async def _unless_disconnected(self, request: Request, call: Awaitable[T]) -> T:
        """The call's result, or ClientGone (the call cancelled) when the client leaves first."""
        task = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()  # cancels the worker's call: the worker frees the sequence
                await asyncio.wait({task})  # a stream's generator is closed only once it stopped
        if not task.done() or task.cancelled():
            raise ClientGone()
        return task.result()

    async def _stream(
        self, request: Request, plan: Plan, endpoint: Endpoint, start: float, line: dict
    ) -> Response:
        """Waits for the first delta, so a failure before any token (unknown model, overload) is an
        HTTP error; then streams the rest as server-sent events ending in `data: [DONE]`."""
        deltas = self.backend.stream(plan.adapter_id, **plan.kwargs)
        try:
            first = await self._unless_disconnected(request, anext(deltas))
        except BaseException:
            await deltas.aclose()
            raise
        chunks = CompletionChunks(plan) if endpoint == "completions" else ChatChunks(plan)
        self.metrics.ttft.observe(time.perf_counter() - start)
        line["ttft_ms"] = round((time.perf_counter() - start) * 1e3, 3)
        return EventSourceResponse(self._events(deltas, first, chunks, endpoint, start, line))

    async def _events(
        self,
        deltas: AsyncGenerator[Delta, None],
        first: Delta,
        chunks: CompletionChunks | ChatChunks,
        endpoint: Endpoint,
        start: float,
        line: dict,
    ) -> AsyncIterator[bytes]:
        status = 200
        try:
            async with aclosing(deltas):
                for chunk in chunks.first():
                    yield _sse(chunk)
                delta: Delta | None = first
                while delta is not None:
                    arrived = time.perf_counter()
                    self.metrics.tokens.inc(len(delta.token_ids))
                    for chunk in chunks.delta(delta):
                        yield _sse(chunk)  # resumes once the HTTP server took the bytes
                    if delta.usage is not None:
                        line.update(
                            tokens_in=delta.usage.prompt_tokens, tokens_out=delta.usage.completion_tokens
                        )
                    if delta.usage is not None and chunks.plan.include_usage:
                        yield _sse(chunks.usage(delta.usage))
                    self.metrics.relay.observe(time.perf_counter() - arrived)
                    delta = await anext(deltas, None)
            yield DONE
        except grpc.RpcError as exc:  # after the first token: the status line is sent already
            error = APIError.from_rpc(exc, chunks.plan.names)
            status = error.status
            yield _sse(error.body())
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED
            self.metrics.disconnects.inc()
            raise
        finally:
            self._done(endpoint, status, start, line)
