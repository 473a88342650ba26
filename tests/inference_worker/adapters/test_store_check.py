"""The store check (the store's listing against what the worker holds) and what starts it early:
the coordinator sync, when the coordinator's epoch changes (Redis lost its data)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from loraserve.inference_worker.adapters.coordinator_sync import CoordinatorSync
from loraserve.inference_worker.adapters.store_check import StoreCheck
from loraserve.inference_worker.coordination import InProcessCoordinator


def test_changes_at_the_store_are_announced_once() -> None:
    store = {"kept": "d1", "swapped": "d3"}
    held = {"kept": "d1", "swapped": "d2", "gone": "d4"}
    published: list[tuple[str, str, str]] = []

    async def listing() -> dict[str, str]:
        return dict(store)

    check = StoreCheck(listing, lambda: dict(held), lambda *e: published.append(e))
    assert asyncio.run(check.check()) == 2
    assert sorted(published) == [("gone", "", "deleted"), ("swapped", "d3", "registered")]
    assert asyncio.run(check.check()) == 0


def test_check_soon_runs_the_check_before_the_interval_ends() -> None:
    async def scenario() -> int:
        rounds = 0
        ran = asyncio.Event()

        async def listing() -> dict[str, str]:
            nonlocal rounds
            rounds += 1
            ran.set()
            return {}

        check = StoreCheck(listing, dict, lambda *e: None, interval_s=3600)
        check.check_soon()  # not started: nothing to wake
        check.start(asyncio.get_running_loop())
        await asyncio.wait_for(ran.wait(), 5)  # the first round, at start
        ran.clear()
        await asyncio.sleep(0.05)
        check.check_soon()
        await asyncio.wait_for(ran.wait(), 5)
        await check.stop()
        return rounds

    assert asyncio.run(scenario()) == 2


def _sync(coordinator, on_lost) -> CoordinatorSync:
    return CoordinatorSync(
        coordinator,
        apply=lambda e: None,
        flush_residency=lambda: 0,
        heartbeat_info=dict,
        worker_id="w1",
        on_state_lost=on_lost,
    )


def test_a_kept_state_starts_no_store_check() -> None:
    lost: list[int] = []
    sync = _sync(InProcessCoordinator(), lambda: lost.append(1))
    assert not sync.check_epoch() and not sync.check_epoch() and lost == []


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")
def test_a_flushed_redis_starts_a_store_check(tmp_path) -> None:
    import redis

    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator
    from tests.helpers.private_redis import PrivateRedis

    server = PrivateRedis(tmp_path, ("--save", "", "--appendonly", "no"))
    server.start()
    coordinator = RedisCoordinator(server.url, "loraserve-sync:")
    lost: list[int] = []
    try:
        sync = _sync(coordinator, lambda: lost.append(1))
        assert not sync.check_epoch() and not sync.check_epoch()
        redis.Redis.from_url(server.url).flushall()
        assert sync.check_epoch() and lost == [1]
        assert not sync.check_epoch() and lost == [1]
        server.stop()  # unreachable: no epoch read, nothing lost
        assert not sync.check_epoch() and lost == [1]
    finally:
        coordinator.close()
        server.stop()
