"""The shared interceptors on a real grpc.aio server (port 0): domain errors become their status in
unary and streaming RPCs (also mid-stream), anything unexpected becomes INTERNAL (never UNKNOWN),
a handler's own abort passes through, and bearer tokens guard the methods named, streams too."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest

from loraserve.serving.background import BackgroundServer
from loraserve.serving.errors import MAX_STATUS_MESSAGE_BYTES, ServiceError, status_of
from loraserve.serving.interceptors import BearerTokenInterceptor, ErrorStatusInterceptor

C = grpc.StatusCode


class Missing(ServiceError):
    code = "NOT_FOUND"


def _fail(what: bytes) -> None:
    if what == b"missing":
        raise Missing("no adapter 'x'")
    if what == b"bug":
        raise RuntimeError("boom")


async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"abort":
        await context.abort(C.OUT_OF_RANGE, "handler's own status")
    _fail(request)
    return b"ok:" + request


async def stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    _fail(request)
    yield b"second"


async def written(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.write(b"first")
    _fail(request)


async def start_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(
        interceptors=[
            BearerTokenInterceptor({"/t.T/Guarded": "tok", "/t.T/GuardedStream": "tok", "/t.T/Open": ""}),
            ErrorStatusInterceptor(logging.getLogger("test")),
        ]
    )
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Written": grpc.unary_stream_rpc_method_handler(written),
        "Guarded": grpc.unary_unary_rpc_method_handler(unary),
        "GuardedStream": grpc.unary_stream_rpc_method_handler(stream),
        "Open": grpc.unary_unary_rpc_method_handler(unary),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    bg: BackgroundServer[grpc.aio.Server] = BackgroundServer(start_server, "127.0.0.1", "interceptors")
    with grpc.insecure_channel(bg.address) as ch:
        yield ch
    assert bg.server is not None
    bg.call(bg.server.stop(0))


def failure(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_status_of_maps_domain_errors_and_bugs() -> None:
    assert status_of(Missing("no adapter 'x'")) == ("NOT_FOUND", "no adapter 'x'")
    assert status_of(ValueError("bad")) == ("INTERNAL", "internal error: ValueError: bad")


@pytest.mark.parametrize("text", ["x" * 100_000, "\u00e9" * 100_000, "%" * 100_000, "\U0001f600" * 100_000])
def test_status_messages_are_cut_to_what_grpc_delivers(text: str) -> None:
    """A message quoting a client's input is cut where its percent-encoded form (grpc-message)
    passes MAX_STATUS_MESSAGE_BYTES, far under the client's 8 KiB metadata limit."""
    _, message = status_of(Missing(f"bad value {text!r}"))
    assert message.startswith("bad value '") and message.endswith("...")
    encoded = sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in message)
    assert MAX_STATUS_MESSAGE_BYTES - 64 <= encoded <= MAX_STATUS_MESSAGE_BYTES


def test_unary(channel: grpc.Channel) -> None:
    call = channel.unary_unary("/t.T/Unary")
    assert call(b"fine", timeout=10) == b"ok:fine"
    assert failure(lambda: call(b"missing", timeout=10)) == (C.NOT_FOUND, "no adapter 'x'")
    assert failure(lambda: call(b"bug", timeout=10)) == (C.INTERNAL, "internal error: RuntimeError: boom")
    assert failure(lambda: call(b"abort", timeout=10)) == (C.OUT_OF_RANGE, "handler's own status")


@pytest.mark.parametrize("method", ["/t.T/Stream", "/t.T/Written"])
def test_streams_fail_mid_stream_with_the_status(channel: grpc.Channel, method: str) -> None:
    call = channel.unary_stream(method)
    got: list[bytes] = []
    code, details = failure(lambda: got.extend(call(b"missing", timeout=10)))
    assert (code, details, got) == (C.NOT_FOUND, "no adapter 'x'", [b"first"])
    got.clear()
    code, details = failure(lambda: got.extend(call(b"bug", timeout=10)))
    assert (code, got) == (C.INTERNAL, [b"first"]) and "RuntimeError: boom" in details
    if method == "/t.T/Stream":
        assert list(call(b"fine", timeout=10)) == [b"first", b"second"]


def test_bearer_tokens_guard_named_methods_unary_and_streaming(channel: grpc.Channel) -> None:
    guarded, guarded_stream = channel.unary_unary("/t.T/Guarded"), channel.unary_stream("/t.T/GuardedStream")
    code, details = failure(lambda: guarded(b"fine", timeout=10))
    assert code == C.UNAUTHENTICATED and "/t.T/Guarded" in details and "Bearer" in details
    wrong = [("authorization", "Bearer nope")]
    assert (
        failure(lambda: list(guarded_stream(b"fine", timeout=10, metadata=wrong)))[0] == C.PERMISSION_DENIED
    )
    right = [("authorization", "Bearer tok")]
    assert guarded(b"fine", timeout=10, metadata=right) == b"ok:fine"
    assert list(guarded_stream(b"fine", timeout=10, metadata=right)) == [b"first", b"second"]
    # behind the token, errors are still mapped; a method named with an empty token is open
    assert failure(lambda: guarded(b"missing", timeout=10, metadata=right))[0] == C.NOT_FOUND
    assert channel.unary_unary("/t.T/Open")(b"fine", timeout=10) == b"ok:fine"
    assert failure(lambda: channel.unary_unary("/t.T/Nope")(b"", timeout=10))[0] == C.UNIMPLEMENTED
