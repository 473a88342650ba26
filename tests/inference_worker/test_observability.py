"""Seeing into a request: one trace from the caller through the worker (queue, adapter loads by
tier, prefill, decode) into the store's fetch, and one access-log line per call on both services."""

from __future__ import annotations

import json
import logging
import time

import grpc
import pytest

from loraserve.serving.logs import JsonLogFormatter
from loraserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.tracing import wait_for_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
GENERATE = "loraserve.v1.InferenceWorker/Generate"
FETCH = "loraserve.v1.AdapterStore/FetchAdapter"


def _generate(address: str, adapter_id: str, metadata=()):
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.InferenceWorkerStub(channel).Generate(
            worker_pb2.GenerateRequest(
                request_id="req-1",
                prompt_token_ids=[5, 17, 42, 99],
                adapter_id=adapter_id,
                sampling=worker_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            ),
            metadata=metadata,
            timeout=60,
        )


def _access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "loraserve.access" and r.levelno == logging.INFO]


def _access_lines(caplog) -> list[dict]:
    return [r.fields for r in _access_records(caplog)]


@pytest.fixture
def lora_worker(start_worker, lora_store):
    return start_worker(
        store_address=lora_store.address, max_num_batched_tokens=64, max_loras=2, max_cpu_loras=4
    )


def test_one_trace_spans_caller_worker_and_store_for_a_fetched_adapter(spans, lora_worker) -> None:
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    out = _generate(lora_worker.address, "qv-r8", metadata=(("traceparent", traceparent),))
    assert len(out.completions[0].token_ids) == 4

    finished = wait_for_spans(spans, lambda s: any(x.name == GENERATE for x in s))
    ours = [s for s in finished if f"{s.context.trace_id:032x}" == TRACE_ID]
    by_name: dict[str, list] = {}
    for s in ours:
        by_name.setdefault(s.name, []).append(s)
    assert {GENERATE, FETCH, "store.fetch", "worker.adapter_load", "worker.queue", "worker.prefill"} <= set(
        by_name
    ), sorted(by_name)

    # the worker continues the caller's trace; its phases hang under its server span
    (generate,) = by_name[GENERATE]
    assert generate.parent.span_id == int(CALLER_SPAN, 16) and generate.parent.is_remote
    assert generate.attributes["rpc.grpc.status_code"] == 0
    assert generate.attributes["loraserve.adapter.id"] == "qv-r8"
    assert generate.attributes["loraserve.tokens_out"] == 4
    for phase in ("worker.queue", "worker.prefill", "worker.decode"):
        (span,) = by_name[phase]
        assert span.parent.span_id == generate.context.span_id
        assert span.attributes["loraserve.duration_ms"] >= 0
    queue, prefill, decode = (by_name[p][0] for p in ("worker.queue", "worker.prefill", "worker.decode"))
    assert queue.end_time <= prefill.start_time + 1 and prefill.end_time <= decode.start_time + 1

    # the adapter was fetched (CPU tier) and then copied into a slot (GPU tier), both in this trace
    loads = {s.attributes["loraserve.adapter.tier"]: s for s in by_name["worker.adapter_load"]}
    assert set(loads) == {"cpu", "gpu"}
    for tier, span in loads.items():
        assert span.attributes["loraserve.adapter.id"] == "qv-r8", tier
        assert span.attributes["loraserve.load_ms"] > 0 and span.attributes["loraserve.bytes"] > 0
        assert span.parent.span_id == generate.context.span_id, tier
    # the fetch left the worker with the trace context: the store's span is a child of the load
    (fetch,) = by_name[FETCH]
    assert fetch.parent.span_id == loads["cpu"].context.span_id and fetch.parent.is_remote
    (store_fetch,) = by_name["store.fetch"]
    assert store_fetch.parent.span_id == fetch.context.span_id
    assert store_fetch.attributes["loraserve.store.cache"] in ("hit", "miss")
    assert store_fetch.attributes["loraserve.bytes"] == loads["cpu"].attributes["loraserve.bytes"]


def test_a_failed_call_is_an_error_span(spans, lora_worker) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _generate(lora_worker.address, "no-such-adapter")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # the store's span ends after its answer, which may reach the worker (and the caller) first
    finished = wait_for_spans(spans, lambda s: {GENERATE, FETCH} <= {x.name for x in s})
    (generate,) = [s for s in finished if s.name == GENERATE]
    assert generate.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert generate.status.status_code.name == "ERROR"
    # a trace started here (no caller context) still reaches the store
    assert any(s.name == FETCH and s.context.trace_id == generate.context.trace_id for s in finished)


def test_one_access_line_per_call_on_worker_and_store(caplog, lora_worker) -> None:
    caplog.set_level(logging.INFO, logger="loraserve.access")
    _generate(lora_worker.address, "all-r4")
    fmt = JsonLogFormatter()
    lines = [json.loads(fmt.format(r)) for r in _access_records(caplog)]
    worker = [x for x in lines if x["service"] == "worker"]
    store = [x for x in lines if x["service"] == "store"]
    assert len(worker) == 1 and len(store) == 1, lines
    (w,) = worker
    assert w["method"] == "Generate" and w["status"] == "OK" and w["request_id"] == "req-1"
    assert w["adapter"] == "all-r4" and w["tokens_in"] == 4 and w["tokens_out"] == 4
    assert 0 <= w["queue_ms"] <= w["ttft_ms"] <= w["engine_ms"] <= w["total_ms"] + 1
    assert w["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:"))
    (s,) = store
    assert s["method"] == "FetchAdapter" and s["status"] == "OK" and s["adapter"] == "all-r4"
    assert s["bytes"] > 0 and s["cache"] in ("hit", "miss") and s["total_ms"] >= 0
    assert "trace_id" not in w  # tracing is off here


def test_a_refused_call_is_logged_with_its_status(caplog, start_worker) -> None:
    caplog.set_level(logging.INFO, logger="loraserve.access")
    bg = start_worker(generate_token="s3cret")
    with pytest.raises(grpc.RpcError) as err:
        _generate(bg.address, "")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the status reaches the caller as the call aborts, a moment before the line is written
    deadline = time.monotonic() + 5
    while not (lines := _access_lines(caplog)) and time.monotonic() < deadline:
        time.sleep(0.01)
    (line,) = lines
    assert line["status"] == "UNAUTHENTICATED" and line["method"] == "Generate"


def test_per_adapter_metrics_of_a_served_request(lora_worker) -> None:
    value = lora_worker.server.metrics.registry.get_sample_value
    steps, adapters = (value(f"loraserve_worker_step_adapters_{k}") for k in ("count", "sum"))
    _generate(lora_worker.address, "mlp-rs16")
    # every step of the one request had that one adapter's rows
    ran = value("loraserve_worker_step_adapters_count") - steps
    assert ran > 0 and value("loraserve_worker_step_adapters_sum") - adapters == ran
    one = {"adapter": "mlp-rs16"}
    assert value("loraserve_worker_per_adapter_requests_total", {**one, "code": "OK"}) == 1
    assert value("loraserve_worker_per_adapter_prompt_tokens_total", one) == 4
    assert value("loraserve_worker_per_adapter_generated_tokens_total", one) == 4
    for tier in ("cpu", "gpu"):  # fetched from the store, then copied into a slot
        assert value("loraserve_worker_per_adapter_load_seconds_count", {**one, "tier": tier}) == 1
        assert value("loraserve_worker_per_adapter_load_seconds_sum", {**one, "tier": tier}) > 0
    assert value("loraserve_worker_per_adapter_resident", {**one, "tier": "gpu"}) == 1
