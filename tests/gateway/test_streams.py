"""Many streams at once through the gateway: several adapters and the base model share the worker's
batches and each stream equals its lone greedy result; a client that goes away (streaming or not)
cancels its generation and the worker frees the sequence."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers.gateway import ADAPTERS, API_KEY

PROMPTS = ("Once upon a time", "The quick brown fox", "Hello world")


def _cancelled(worker, method: str) -> float:
    value = worker.server.metrics.registry.get_sample_value(
        "loraserve_worker_requests_total", {"method": method, "code": "CANCELLED"}
    )
    return value or 0.0


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def batches(gateway_worker):
    """The adapter ids of each batch the worker's engine runs while the test runs."""
    runner = gateway_worker.engine.runner
    seen: list[set[str]] = []
    execute = runner.execute

    def recording(sched, prev_tokens=None):
        logits, seqs = execute(sched, prev_tokens)
        seen.append({s.adapter_id for s in seqs})
        return logits, seqs

    runner.execute = recording
    yield seen
    del runner.execute  # the class's method again


def test_concurrent_streams_for_several_adapters_share_batches(
    client, gateway, gateway_worker, batches
) -> None:
    base = client.models.list().data[0].id
    models = [base, *ADAPTERS]
    jobs = [(m, p) for m in models for p in PROMPTS]
    kw = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    alone = {(m, p): client.completions.create(model=m, prompt=p, **kw).choices[0].text for m, p in jobs}
    batches.clear()

    async def stream_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0) as c:

            async def one(model: str, prompt: str) -> str:
                chunks = await c.completions.create(model=model, prompt=prompt, stream=True, **kw)
                return "".join([ch.choices[0].text async for ch in chunks if ch.choices])

            return await asyncio.gather(*(one(m, p) for m, p in jobs))

    texts = asyncio.run(stream_all())
    assert dict(zip(jobs, texts, strict=True)) == alone
    mixed = [b for b in batches if "" in b and len(b) >= 3]
    assert mixed, f"no batch held the base model and two adapters: {batches}"


def test_stream_disconnect_frees_the_sequence(client, gateway, gateway_worker) -> None:
    engine = gateway_worker.engine
    before = _cancelled(gateway_worker, "GenerateStream")
    gone = gateway.app.state.metrics.disconnects
    gone_before = gone._value.get()
    stream = client.completions.create(
        model=ADAPTERS[1],
        prompt="Once upon a time",
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert engine.num_running == 1
    stream.close()  # the client goes away mid-stream
    _wait_for(lambda: engine.num_running == 0 and engine.num_waiting == 0)
    _wait_for(lambda: _cancelled(gateway_worker, "GenerateStream") == before + 1)
    _wait_for(lambda: gone._value.get() == gone_before + 1)
    assert "loraserve_gateway_client_disconnects_total" in httpx.get(gateway.url + "/metrics").text


def test_whole_response_disconnect_frees_the_sequence(gateway, gateway_worker) -> None:
    engine = gateway_worker.engine
    before = _cancelled(gateway_worker, "Generate")
    gone = gateway.app.state.metrics.disconnects
    gone_before = gone._value.get()
    body = {"model": ADAPTERS[0], "prompt": "Hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway.url + "/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(60, read=0.5),
        )
    _wait_for(lambda: _cancelled(gateway_worker, "Generate") == before + 1)
    _wait_for(lambda: engine.num_running == 0 and engine.num_waiting == 0)
    _wait_for(lambda: gone._value.get() == gone_before + 1)  # seen as a disconnect, not an error


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(
    tiny_model_dir, gateway_store, start_gateway
) -> None:
    from tests.gateway.conftest import openai_client, start_worker

    worker = start_worker(tiny_model_dir, gateway_store)
    gw = start_gateway(worker=worker.address)
    with openai_client(gw.url) as c:
        stream = c.completions.create(
            model=ADAPTERS[0],
            prompt="Once upon a time",
            max_tokens=2000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        worker.stop()  # the worker goes away mid-stream
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        # the gateway's error event (the openai client raises it), not a dropped connection
        assert not isinstance(e.value, openai.APIConnectionError), repr(e.value)
        assert e.value.body is not None and e.value.body.get("type"), e.value.body
        assert e.value.code in ("service_unavailable", "cancelled", "internal_error"), e.value.body


def test_stream_disconnect_before_its_first_token_frees_the_request(
    tiny_model_dir, gateway_store, start_gateway
) -> None:
    """A stream answers once its first token is there; a client that leaves before (its request
    queued behind a running one) cancels it then, not once it would have run."""
    from tests.gateway.conftest import openai_client, start_worker

    worker = start_worker(tiny_model_dir, gateway_store, max_num_seqs=1)
    try:
        engine = worker.engine
        gw = start_gateway(worker=worker.address)
        gone = gw.app.state.metrics.disconnects
        before = _cancelled(worker, "GenerateStream")
        long = dict(model=ADAPTERS[0], max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})
        with openai_client(gw.url) as c:
            running = c.completions.create(prompt="Once upon a time", stream=True, **long)
            chunks = iter(running)
            next(chunks)
            body = {"model": ADAPTERS[0], "prompt": "Hello", "max_tokens": 4, "stream": True}
            with pytest.raises(httpx.ReadTimeout):  # queued behind the running stream
                with httpx.stream(
                    "POST", gw.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5)
                ) as r:
                    r.read()
            _wait_for(lambda: _cancelled(worker, "GenerateStream") == before + 1, timeout=10)
            assert engine.num_waiting == 0 and engine.num_running == 1  # the first one runs on
            _wait_for(lambda: gone._value.get() == 1)
            next(chunks)
            running.close()
    finally:
        worker.stop()
