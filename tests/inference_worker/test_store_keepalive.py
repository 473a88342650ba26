"""The worker's channels to the store send the clients' keepalive pings (`channel.KEEPALIVE`): the
channel of its fetch threads and store checks, and those its fetch process opens; a fetch from a
store gone silent with its connection open ends within the keepalive's interval and timeout, not
at its deadline, whichever of them runs it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from loraserve.clients.channel import KEEPALIVE, MIN_KEEPALIVE_S, Keepalive
from loraserve.inference_worker.adapters.store_source import StoreSource
from loraserve.inference_worker.errors import DependencyUnavailable
from loraserve.inference_worker.fetching import process as fetch_process
from tests.helpers.fake_workers import FreezingProxy
from tests.helpers.ports import free_port

pytestmark = pytest.mark.timeout(60)
QUICK = Keepalive(interval_s=MIN_KEEPALIVE_S, timeout_s=1.0)  # a ping every 2 s: the fastest allowed
HAS_SHM = fetch_process.FetchProcess.supported()


def _has_keepalive(options: dict) -> bool:
    return options.items() >= dict(KEEPALIVE.options()).items()


def test_the_worker_s_store_channels_carry_the_keepalive(monkeypatch, tmp_path) -> None:
    real: Callable = grpc.insecure_channel
    opened: list[dict] = []

    def spy(*args, options=(), **kw):
        opened.append(dict(options or ()))
        return real(*args, options=options, **kw)

    monkeypatch.setattr(grpc, "insecure_channel", spy)
    source = StoreSource(f"127.0.0.1:{free_port()}", timeout_s=5, max_retries=0, fetch_process=HAS_SHM)

    async def check() -> None:
        try:
            with pytest.raises(DependencyUnavailable):  # (nobody listens there)
                await source.digests()  # the store check, on the fetch threads' channel
        finally:
            await source.close()

    asyncio.run(check())
    assert len(opened) == 1 and _has_keepalive(opened[0])
    if source._process is not None:
        # the fetch process's channels, made from the configuration the worker sends it
        from loraserve.inference_worker.fetching.child import Child

        child = Child({**source._process._config, "directory": str(tmp_path)}, lambda msg: None)
        try:
            assert len(opened) == 1 + source.max_fetches and all(map(_has_keepalive, opened[1:]))
        finally:
            child.threads.shutdown(wait=False)
            for channel in child.channels:
                channel.close()


@pytest.mark.parametrize(
    "in_process",
    [True, pytest.param(False, marks=pytest.mark.skipif(not HAS_SHM, reason="no /dev/shm"))],
    ids=["fetch-threads", "fetch-process"],
)
def test_a_store_gone_silent_ends_a_fetch_within_the_keepalive(lora_store, in_process) -> None:
    proxy = FreezingProxy(lora_store.address)
    source = StoreSource(
        proxy.address,
        timeout_s=30,
        max_retries=0,
        max_fetches=1,  # one connection: the one the first fetch made
        keepalive=QUICK,
        fetch_process=not in_process,
    )

    async def fetch_then_freeze() -> float:
        try:
            assert (await source.fetch("all-r4")).adapter_id == "all-r4"
            proxy.frozen.set()
            t0 = time.monotonic()
            with pytest.raises(DependencyUnavailable, match="UNAVAILABLE"):
                await source.fetch("all-r4")
            return time.monotonic() - t0
        finally:
            await source.close()

    try:
        assert (source._process is None) == in_process
        assert asyncio.run(fetch_then_freeze()) < QUICK.interval_s + QUICK.timeout_s + 2.0
    finally:
        proxy.close()
