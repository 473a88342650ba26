"""The gateway reads the fleet's live workers from Redis in the background: a Redis that takes
connections and never answers stalls no request. Requests route over the last workers read; a
request that comes before any read ended waits for the first one at most --redis-timeout-s, then
--worker stands in, else it fails with 503 in OpenAI's error shape."""

from __future__ import annotations

import time

import openai
import pytest

from tests.helpers.fake_workers import FakeWorker, FreezingProxy, fake_workers, silent_listener
from tests.helpers.gateway import openai_client
from tests.helpers.heartbeats import announce

pytestmark = pytest.mark.timeout(60)
BOUND_S = 0.5  # --redis-timeout-s of these tests
SLACK_S = 1.2  # what a loaded machine may add to a wait


def _text(c: openai.OpenAI) -> tuple[str, float]:
    """The text of one streamed completion and how long it took."""
    t0 = time.monotonic()
    chunks = c.completions.create(model="base", prompt="Hi", max_tokens=2, stream=True)
    return "".join(ch.choices[0].text for ch in chunks), time.monotonic() - t0


def test_with_no_worker_known_a_request_gets_503_within_the_bound(start_gateway) -> None:
    with silent_listener() as redis_address:
        # no --model-name: the base model's name too is asked of a worker
        gw = start_gateway(redis_url=f"redis://{redis_address}/0", redis_timeout_s=BOUND_S)
        with openai_client(gw.url) as c:
            for _ in range(2):  # the first waits for the first read, the next ones not even that
                t0 = time.monotonic()
                with pytest.raises(openai.APIStatusError) as e:
                    c.completions.create(model="base", prompt="Hi", max_tokens=2)
                assert time.monotonic() - t0 < BOUND_S + SLACK_S
                assert e.value.status_code == 503, e.value
                body = e.value.body
                assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
                assert (body["type"], body["code"]) == ("service_unavailable_error", "service_unavailable")
                # Redis has not answered yet, or its read failed (the bound of both is the same)
                assert body["message"].startswith("no inference worker is known (")
                assert "Redis" in body["message"] and body["message"].endswith("and no --worker given)")
            with pytest.raises(openai.APIStatusError) as e:  # the same for /v1/models
                c.models.list()
            assert e.value.status_code == 503


def test_with_no_worker_read_yet_the_given_worker_stands_in(start_gateway) -> None:
    worker = FakeWorker()
    with silent_listener() as redis_address, fake_workers(worker) as (address,):
        gw = start_gateway(
            redis_url=f"redis://{redis_address}/0", redis_timeout_s=BOUND_S, worker=address, model_name="base"
        )
        with openai_client(gw.url) as c:
            text, took = _text(c)
            assert text == address + address and took < BOUND_S + SLACK_S


@pytest.mark.redis
def test_a_redis_gone_silent_stalls_no_request(start_gateway, redis_url, redis_prefix) -> None:
    """The workers were read; then Redis stops answering with its connections open. Over several
    refresh periods every request is routed at once over the workers read before."""
    worker = FakeWorker()
    with fake_workers(worker) as (address,):
        announce(redis_url, redis_prefix, [address])
        host_port, db = redis_url.removeprefix("redis://").split("/", 1)
        proxy = FreezingProxy(host_port)
        try:
            gw = start_gateway(
                redis_url=f"redis://{proxy.address}/{db}",
                redis_prefix=redis_prefix,
                route_refresh_s=0.2,
                redis_timeout_s=5.0,  # a read of the silent Redis holds on for this long
                model_name="base",
            )
            with openai_client(gw.url) as c:
                assert _text(c)[0] == address + address
                proxy.frozen.set()
                time.sleep(0.5)  # a read is now waiting on the silent Redis
                for _ in range(6):
                    text, took = _text(c)
                    assert text == address + address and took < SLACK_S, took
                    time.sleep(0.3)
        finally:
            proxy.close()
