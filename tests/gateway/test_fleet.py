"""The gateway in front of the fleet (--redis-url): it finds the workers by their heartbeats and
routes through the adapter-aware router; with none heartbeating it uses --worker."""

from __future__ import annotations

import pytest

from tests.helpers.gateway import ADAPTERS, openai_client, start_worker

pytestmark = pytest.mark.redis


def test_routes_across_the_workers_that_heartbeat(
    tiny_model_dir, gateway_store, start_gateway, redis_url, redis_prefix
) -> None:
    workers = [
        start_worker(tiny_model_dir, gateway_store, redis_url=redis_url, redis_prefix=redis_prefix)
        for _ in range(2)
    ]
    try:
        gw = start_gateway(redis_url=redis_url, redis_prefix=redis_prefix, route_refresh_s=0.2)
        with openai_client(gw.url) as c:
            for model in ADAPTERS:
                out = c.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
                assert out.usage.completion_tokens >= 1
            chunks = list(
                c.chat.completions.create(
                    model=ADAPTERS[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
                )
            )
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        backend = gw.app.state.backend
        assert set(backend._fleet) == {w.address for w in workers}
        served = sum(w.engine.num_steps > 0 for w in workers)
        assert served >= 1
    finally:
        for w in workers:
            w.stop()


def test_falls_back_to_the_given_worker(gateway_worker, start_gateway, redis_url, redis_prefix) -> None:
    gw = start_gateway(redis_url=redis_url, redis_prefix=redis_prefix, worker=gateway_worker.address)
    with openai_client(gw.url) as c:
        # served by the given worker (sampled at the API's default temperature: the tiny model may
        # end at once with its end-of-sequence token, so the count of tokens is not asserted)
        out = c.completions.create(model=ADAPTERS[0], prompt="Hi", max_tokens=2)
        assert out.usage.prompt_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
