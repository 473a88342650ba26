"""One request of the HTTP API from arrival to its last byte: `RequestHandler.handle` turns the
request into a worker call, answers it whole or as server-sent events, maps failures to OpenAI's
error shape and records the request's metrics. Everything a request does starts and ends in
`handle`, the one place to wrap a request in a trace span.

A client that goes away cancels its generation: a stream through Starlette's disconnect watch
(the response task is cancelled, closing the worker call), a whole response through the watch below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Literal

import grpc
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from loraserve.clients.worker_client import Delta, Generation
from loraserve.gateway.backend import Backend
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.errors import APIError
from loraserve.gateway.metrics import GatewayMetrics
from loraserve.gateway.requests import Plan, chat_plan, completion_plan
from loraserve.gateway.responses import ChatChunks, CompletionChunks, chat_completion, completion
from loraserve.gateway.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("loraserve.gateway")
Endpoint = Literal["completions", "chat.completions"]
DONE = format_sse_event(data_str="[DONE]")
CLIENT_CLOSED = 499  # the status recorded for a client that went away (nginx's convention)


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
        start = time.perf_counter()
        status = 200
        self.metrics.in_flight.inc()
        streaming = False
        try:
            base = await self.backend.base_model()
            plan = (
                completion_plan(body, self.config, base)  # type: ignore[arg-type]
                if endpoint == "completions"
                else chat_plan(body, self.config, base)  # type: ignore[arg-type]
            )
            if plan.stream:
                response = await self._stream(plan, endpoint, start)
                streaming = True  # the stream's own end records it
                return response
            gen = await self._unless_disconnected(
                request, self.backend.generate(plan.adapter_id, **plan.kwargs)
            )
            self.metrics.tokens.inc(gen.usage.completion_tokens)
            out = completion(plan, gen) if endpoint == "completions" else chat_completion(plan, gen)
            return JSONResponse(out.model_dump())
        except grpc.RpcError as exc:
            error = APIError.from_rpc(exc)
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
                self._done(endpoint, status, start)

    def _done(self, endpoint: Endpoint, status: int, start: float) -> None:
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def _unless_disconnected(self, request: Request, call: Awaitable[Generation]) -> Generation:
        """The call's result, or ClientGone (the call cancelled) when the client leaves first."""
        task = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()  # cancels the worker's call: the worker frees the sequence
        if not task.done() or task.cancelled():
            raise ClientGone()
        return task.result()

    async def _stream(self, plan: Plan, endpoint: Endpoint, start: float) -> Response:
        """Waits for the first delta, so a failure before any token (unknown model, overload) is an
        HTTP error; then streams the rest as server-sent events ending in `data: [DONE]`."""
        deltas = self.backend.stream(plan.adapter_id, **plan.kwargs)
        try:
            first = await anext(deltas)
        except BaseException:
            await deltas.aclose()
            raise
        chunks = CompletionChunks(plan) if endpoint == "completions" else ChatChunks(plan)
        self.metrics.ttft.observe(time.perf_counter() - start)
        return EventSourceResponse(self._events(deltas, first, chunks, endpoint, start))

    async def _events(
        self,
        deltas: AsyncGenerator[Delta, None],
        first: Delta,
        chunks: CompletionChunks | ChatChunks,
        endpoint: Endpoint,
        start: float,
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
                    for chunk in chunks.delta(delta):  # type: ignore[attr-defined]
                        yield _sse(chunk)  # resumes once the HTTP server took the bytes
                    if delta.usage is not None and chunks.plan.include_usage:
                        yield _sse(chunks.usage(delta.usage))
                    self.metrics.relay.observe(time.perf_counter() - arrived)
                    delta = await anext(deltas, None)
            yield DONE
        except grpc.RpcError as exc:  # after the first token: the status line is sent already
            error = APIError.from_rpc(exc)
            status = error.status
            yield _sse(error.body())
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED
            self.metrics.disconnects.inc()
            raise
        finally:
            self._done(endpoint, status, start)
