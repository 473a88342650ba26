"""One trace from an HTTP caller through the gateway, the worker and the store for a request whose
adapter the worker had to fetch; and the gateway's access line."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.helpers.gateway import start_worker
from tests.helpers.tracing import wait_for_spans

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
def fresh_worker(tiny_model_dir, gateway_store):
    """A worker holding no adapter yet, started once tracing is on."""
    bg = start_worker(tiny_model_dir, gateway_store)
    yield bg
    bg.stop()


def _by_name(spans: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if f"{s.context.trace_id:032x}" == TRACE_ID:
            out.setdefault(s.name, []).append(s)
    return out


def test_one_trace_spans_gateway_worker_and_store(spans, fresh_worker, start_gateway, caplog) -> None:
    caplog.set_level(logging.INFO, logger="loraserve.access")
    gw = start_gateway(worker=fresh_worker.address)
    # greedy: a sampled end-of-sequence token would end it before max_tokens
    body = {"model": "peft-patterns", "prompt": "hello there", "max_tokens": 3, "temperature": 0}
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
    reply = httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text

    names = {"POST /v1/completions", "loraserve.v1.InferenceWorker/Generate", "store.fetch"}
    by_name = _by_name(wait_for_spans(spans, lambda s: names <= set(_by_name(s))))
    assert names | {"loraserve.v1.AdapterStore/FetchAdapter", "worker.adapter_load"} <= set(by_name)
    (http,) = by_name["POST /v1/completions"]
    assert http.parent.span_id == int(CALLER_SPAN, 16)
    assert http.attributes["http.response.status_code"] == 200
    (generate,) = by_name["loraserve.v1.InferenceWorker/Generate"]
    assert generate.parent.span_id == http.context.span_id and generate.parent.is_remote
    loads = {s.attributes["loraserve.adapter.tier"]: s for s in by_name["worker.adapter_load"]}
    assert set(loads) == {"cpu", "gpu"}
    assert all(s.parent.span_id == generate.context.span_id for s in loads.values())
    assert all(s.attributes["loraserve.load_ms"] > 0 for s in loads.values())
    (fetch,) = by_name["loraserve.v1.AdapterStore/FetchAdapter"]
    assert fetch.parent.span_id == loads["cpu"].context.span_id
    assert by_name["store.fetch"][0].attributes["loraserve.store.cache"] in ("hit", "miss")

    gateway_lines = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("service") == "gateway"]
    (line,) = gateway_lines
    assert line["method"] == "completions" and line["status"] == 200 and line["model"] == "peft-patterns"
    assert line["tokens_out"] == 3 and line["tokens_in"] > 0 and line["total_ms"] > 0
    assert line["peer"].startswith("127.0.0.1:")


def test_a_stream_continues_the_trace_into_the_worker(spans, gateway_worker, start_gateway) -> None:
    gw = start_gateway(worker=gateway_worker.address)
    body = {"model": "peft-qv-r8", "prompt": "hi", "max_tokens": 2, "stream": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert "[DONE]" in r.read().decode()
    stream = "loraserve.v1.InferenceWorker/GenerateStream"
    by_name = _by_name(wait_for_spans(spans, lambda s: stream in _by_name(s)))
    (http,) = by_name["POST /v1/completions"]
    (worker,) = by_name[stream]
    assert worker.parent.span_id == http.context.span_id
