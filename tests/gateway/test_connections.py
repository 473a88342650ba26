"""A gateway in front of a worker with several front processes: with --worker-connections N it
opens N connections of its own to the worker and takes them in turn, so each front gets some of
the generations (one connection would land on one front); every completion is whole."""

from __future__ import annotations

import pytest

from loraserve.gateway.config import GatewayConfig
from tests.helpers.gateway import ADAPTERS, openai_client, start_worker


@pytest.fixture
def two_fronts(tiny_model_dir, gateway_store):
    bg = start_worker(tiny_model_dir, gateway_store, stream_process=True, stream_processes=2)
    yield bg
    bg.stop()


def test_generations_spread_over_the_worker_s_fronts(two_fronts, start_gateway) -> None:
    gw = start_gateway(worker=two_fronts.address, worker_connections=8)
    with openai_client(gw.url) as c:
        for i in range(16):
            kw = dict(model=ADAPTERS[i % 2], prompt="Hello", max_tokens=3, temperature=0)
            if i % 2:
                text = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
                assert isinstance(text, str)
            else:
                assert c.completions.create(**kw).usage.completion_tokens == 3
    calls = two_fronts.server.relay.calls_by_front
    # 8 connections in turn, 2 generations each: all 8 on one front has odds 2 ** -7
    assert sum(calls) == 16 and min(calls) >= 1, calls


def test_worker_connections_must_be_positive() -> None:
    with pytest.raises(ValueError, match="worker_connections must be positive"):
        GatewayConfig(worker="127.0.0.1:1", worker_connections=0)
