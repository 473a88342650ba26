"""A worker that takes a stream and never answers it, in front of the gateway's fleet (--redis-url):
the stream ends at its first-message bound (--first-message-timeout-s, else the request's deadline)
with 504, and the worker is out of routing for the router's down period, as one that answers
UNAVAILABLE is: the next requests go to the other worker."""

from __future__ import annotations

import time

import openai
import pytest

from tests.helpers.fake_workers import FakeWorker, fake_workers
from tests.helpers.gateway import openai_client
from tests.helpers.heartbeats import announce

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    "bound",
    [dict(first_message_timeout_s=0.5), dict(request_timeout_s=1.0)],
    ids=["first-message", "deadline"],
)
def test_a_worker_whose_stream_does_not_start_is_left_out(
    start_gateway, redis_url, redis_prefix, bound
) -> None:
    holder, other = FakeWorker(gpu={"x"}), FakeWorker()  # the router's first choice for "x": its holder
    holder.hung_generations = True  # it answers the router's reads, never a generation
    with fake_workers(holder, other) as (a, b):
        announce(redis_url, redis_prefix, [a, b])
        gw = start_gateway(redis_url=redis_url, redis_prefix=redis_prefix, model_name="base", **bound)
        with openai_client(gw.url) as c:
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True)
            assert e.value.status_code == 504 and e.value.code == "timeout", e.value
            assert time.monotonic() - t0 < 5.0
            for _ in range(3):
                chunks = c.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True)
                assert "".join(ch.choices[0].text for ch in chunks) == b + b  # the other worker's
        assert holder.calls.count("GenerateStream") == 1
        assert other.calls.count("GenerateStream") == 3
