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


def test_a_hung_worker_is_routed_to_again_after_its_down_period(
    start_gateway, redis_url, redis_prefix
) -> None:
    """--worker-down-s: the holder of "x" hangs and is left out; once the down period is over it is
    read again (at a request, which goes elsewhere: decisions never wait for a read) and then gets
    "x" again, and hangs again."""
    # the other worker is busier: once it has served "x" too, the holder still comes first
    holder, other = FakeWorker(gpu={"x"}), FakeWorker(load=8)
    holder.hung_generations = True
    with fake_workers(holder, other) as (a, b):
        announce(redis_url, redis_prefix, [a, b])
        gw = start_gateway(
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            model_name="base",
            first_message_timeout_s=0.5,
            worker_down_s=1.0,
        )
        with openai_client(gw.url) as c:
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True)
            assert e.value.status_code == 504, e.value
            down_at, back_at = time.monotonic(), None
            while back_at is None and time.monotonic() - down_at < 10.0:
                try:
                    chunks = c.completions.create(model="x", prompt="Hi", max_tokens=2, stream=True)
                    assert "".join(ch.choices[0].text for ch in chunks) == b + b  # the other worker's
                except openai.APIStatusError as again:
                    assert again.status_code == 504, again
                    back_at = time.monotonic()
                time.sleep(0.05)
        assert back_at is not None, "the hung worker never came back into routing"
        # not before its down period of 1 s (a 504 comes 0.5 s after its send), not the default 5 s
        assert 0.9 <= back_at - down_at < 4.0
        assert holder.calls.count("GenerateStream") == 2
        assert other.calls.count("GenerateStream") >= 2
