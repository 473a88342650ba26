"""How a step's outputs reach the calls on the event loop: one call's failure never holds the
others' back; a relayed stream's running outputs go straight to the front (no task switch per
token) while its last output ends the call through its task; nothing is sent for a call after
its end; the front builds from a running output's fields the message the worker would have sent."""

from __future__ import annotations

import asyncio

import grpc

from loraserve.contract.usage import Usage
from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput
from loraserve.inference_worker.output_delivery import Handover, coalesce, deliver, split
from loraserve.inference_worker.outputs_pb import FINISH, stream_message
from loraserve.inference_worker.relay.core import RelayServer
from loraserve.inference_worker.relay.deltas import delta_message
from loraserve.v1 import worker_pb2


def test_a_failing_callback_does_not_hold_back_the_others() -> None:
    got: list[str] = []

    def broken(out: RequestOutput) -> None:
        raise RuntimeError("closed")

    outs = [RequestOutput(r, [1], "x") for r in ("a", "b", "c")]
    deliver([(got.append if o.request_id != "b" else broken, o) for o in outs])  # type: ignore[misc]
    assert got == [outs[0], outs[2]]  # type: ignore[comparison-overlap]


def test_running_outputs_go_direct_and_the_last_is_queued() -> None:
    direct: list[RequestOutput] = []
    queued: list[RequestOutput] = []
    on_output = split(direct.append, queued.append)
    running = RequestOutput("r", [1], "a")
    ended_one = RequestOutput("r", [2], "b", finish_reason=FinishReason.LENGTH, index=1)  # n = 2
    last = RequestOutput("r", [3], "c", finish_reason=FinishReason.STOP, usage=Usage(3, 3, 1.0, 2.0, 3.0))
    failed = RequestOutput("r", [], "", error=RuntimeError("rank lost"))
    for out in (running, ended_one, last, failed):
        on_output(out)
    assert direct == [running, ended_one] and queued == [last, failed]


def test_a_failed_direct_send_ends_the_call_with_its_error() -> None:
    queued: list[RequestOutput] = []

    def broken(out: RequestOutput) -> None:
        raise ValueError("cannot encode")

    split(broken, queued.append)(RequestOutput("r", [1], "a"))
    (out,) = queued
    assert out.last and isinstance(out.error, RuntimeError) and "cannot encode" in str(out.error)


class _Frames:
    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def add(self, op: tuple) -> None:
        self.ops.append(op)


def test_a_relayed_stream_sends_direct_messages_until_its_end() -> None:
    streams = []

    async def behavior(request: bytes, context):  # type: ignore[no-untyped-def]
        streams.append(context.relay_stream)
        context.relay_stream.message(b"direct")
        context.relay_stream.delta(("r", "a", [1], 0, 0))
        yield b"yielded"

    handler = grpc.unary_stream_rpc_method_handler(
        behavior, request_deserializer=lambda b: b, response_serializer=lambda m: m + b"!"
    )
    generic = grpc.method_handlers_generic_handler("svc", {"Stream": handler})
    relay = RelayServer(
        object(),
        lambda _servicer, registry: registry.add_generic_rpc_handlers([generic]),
        [],
        ["/svc/Stream"],
    )
    frames = _Frames()
    asyncio.run(relay._call(frames, 7, "/svc/Stream", b"", None, [], "peer"))  # type: ignore[arg-type]
    streams[0].message(b"late")  # outputs that arrive after the call ended: dropped
    streams[0].delta(("r", "b", [2], 0, 0))
    assert not streams[0].text_in_front
    assert frames.ops == [
        ("message", 7, b"direct!"),
        ("delta", 7, ("r", "a", [1], 0, 0)),
        ("message", 7, b"yielded!"),
        ("end", 7, None),
    ]


def test_a_delta_is_the_message_the_worker_would_have_sent() -> None:
    outs = [
        RequestOutput("r", [5, 6], "ab", index=1),
        RequestOutput("r", [], "", finish_reason=FinishReason.LENGTH),
        RequestOutput("r", [7], "é", finish_reason=FinishReason.EOS),
    ]
    for out in outs:
        finish = FINISH[out.finish_reason] if out.finish_reason is not None else 0
        sent = worker_pb2.GenerateStreamResponse.FromString(
            delta_message((out.request_id, out.text, out.token_ids, out.index, finish))
        )
        assert sent == stream_message(out, lambda t: ("", b""))


def test_outputs_handed_over_while_the_loop_was_busy_are_merged() -> None:
    got: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    step1 = [(got["a"].append, RequestOutput("a", [1], "x")), (got["b"].append, RequestOutput("b", [7], "p"))]
    step2 = [
        (got["a"].append, RequestOutput("a", [2], "y", finish_reason=FinishReason.LENGTH)),
        (got["b"].append, RequestOutput("b", [8], "q", index=1)),  # another completion: not merged
    ]
    step3 = [(got["a"].append, RequestOutput("a", [], "", usage=Usage(1, 2, 1.0, 2.0, 3.0)))]

    async def run() -> None:
        handover = Handover(asyncio.get_running_loop())
        for step in (step1, step2, step3):  # three steps before the loop gets to run
            handover.dispatch(step)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # one step while the loop keeps up: delivered as it is
        handover.dispatch([(got["b"].append, RequestOutput("b", [9], "r"))])
        await asyncio.sleep(0)

    asyncio.run(run())
    a, b = got["a"], got["b"]
    # a's two running outputs merged; the one after its ending is not merged into it
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [
        ([1, 2], "xy", FinishReason.LENGTH),
        ([], "", None),
    ]
    assert a[1].usage is not None
    assert [(o.token_ids, o.index) for o in b] == [([7], 0), ([8], 1), ([9], 0)]


def test_coalesce_never_merges_past_an_error() -> None:
    cb: list[RequestOutput] = []
    items = [
        (cb.append, RequestOutput("r", [1], "a")),
        (cb.append, RequestOutput("r", [], "", error=RuntimeError("lost"))),
        (cb.append, RequestOutput("r", [2], "b")),
    ]
    assert [o for _, o in coalesce(items)] == [o for _, o in items]  # type: ignore[misc]
