"""The Coordinator contract, run against every implementation."""

from __future__ import annotations

import shutil
import time

import pytest

from loraserve.inference_worker.coordination import (
    FIRST_EVENT_ID,
    Coordinator,
    InProcessCoordinator,
    Residency,
)


@pytest.fixture(params=["in_process", pytest.param("redis", marks=pytest.mark.redis)])
def coordinator(request) -> Coordinator:
    if request.param == "in_process":
        yield InProcessCoordinator()
        return
    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

    c = RedisCoordinator(request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix"))
    yield c
    c.close()


def test_implements_protocol(coordinator):
    assert isinstance(coordinator, Coordinator)


def test_epoch_is_stable_while_the_state_is_kept(coordinator):
    epoch = coordinator.epoch()
    assert epoch
    coordinator.put_residency(Residency("w1", "a", "d1", "gpu", 0, coordinator.tick()))
    coordinator.set_pin("w1", "a", True)
    coordinator.release_worker("w1")
    assert coordinator.epoch() == epoch


def test_clock_is_monotonic(coordinator):
    ticks = [coordinator.tick() for _ in range(5)]
    assert ticks == sorted(ticks) and len(set(ticks)) == 5


def test_residency_per_worker(coordinator):
    coordinator.put_residency(Residency("w1", "a", "d1", "gpu", 0, 3))
    coordinator.put_residency(Residency("w1", "b", "d2", "cpu", -1, 1))
    coordinator.put_residency(Residency("w2", "a", "d1", "cpu", -1, 2))
    coordinator.put_residency(Residency("w1", "a", "d1", "gpu", 1, 4))  # replaces
    w1 = {r.adapter_id: r for r in coordinator.residencies("w1")}
    assert w1["a"].slot == 1 and w1["a"].last_used == 4 and w1["b"].tier == "cpu"
    assert len(coordinator.residencies()) == 3
    coordinator.drop_residency("w1", "a")
    assert [r.adapter_id for r in coordinator.residencies("w1")] == ["b"]


def test_heartbeats_expire_and_release(coordinator):
    coordinator.heartbeat("w1", "127.0.0.1:1", 30.0, {"slots_used": 1})
    coordinator.heartbeat("w2", "127.0.0.1:2", 0.05, {})
    time.sleep(0.1)
    assert [h.worker_id for h in coordinator.live_workers()] == ["w1"]
    coordinator.put_residency(Residency("w1", "a", "d", "gpu", 0, 1))
    coordinator.set_pin("w1", "a", True)
    coordinator.release_worker("w1")
    assert coordinator.live_workers() == [] and coordinator.residencies("w1") == []
    assert coordinator.pins("w1") == set()


def test_popularity_sums_live_workers_and_expires(coordinator):
    assert coordinator.fleet_popularity() == {}
    coordinator.publish_popularity("w1", {"a": 3.5, "b": 1.0}, 30.0)
    coordinator.publish_popularity("w2", {"a": 0.5, "c": 2.0}, 0.05)
    assert coordinator.fleet_popularity() == {"a": 4.0, "b": 1.0, "c": 2.0}
    time.sleep(0.1)
    assert coordinator.fleet_popularity() == {"a": 3.5, "b": 1.0}
    coordinator.publish_popularity("w1", {"b": 0.25}, 30.0)  # replaces w1's table
    assert coordinator.fleet_popularity() == {"b": 0.25}
    coordinator.release_worker("w1")
    assert coordinator.fleet_popularity() == {}


def test_an_idle_worker_publishes_an_empty_table(coordinator):
    coordinator.publish_popularity("busy", {"a": 2.0}, 30.0)
    coordinator.publish_popularity("idle", {}, 30.0)  # counts nothing, still reads the fleet's
    assert coordinator.fleet_popularity() == {"a": 2.0}
    coordinator.publish_popularity("busy", {}, 30.0)  # everything decayed away
    assert coordinator.fleet_popularity() == {}
    coordinator.publish_popularity("idle", {"b": 1.5}, 30.0)
    assert coordinator.fleet_popularity() == {"b": 1.5}


def test_pins(coordinator):
    coordinator.set_pin("w1", "a", True)
    coordinator.set_pin("w1", "b", True)
    coordinator.set_pin("w1", "a", False)
    assert coordinator.pins("w1") == {"b"} and coordinator.pins("w2") == set()


def test_invalidations_are_read_from_a_cursor(coordinator):
    first = coordinator.publish_invalidation("a", "d2", "registered")
    coordinator.publish_invalidation("b", "", "deleted")
    events = coordinator.read_invalidations(FIRST_EVENT_ID)
    assert [(e.adapter_id, e.digest, e.reason) for e in events] == [
        ("a", "d2", "registered"),
        ("b", "", "deleted"),
    ]
    assert [e.adapter_id for e in coordinator.read_invalidations(first)] == ["b"]
    assert coordinator.read_invalidations(events[-1].event_id) == []


@pytest.mark.redis
def test_store_registry_events_reach_workers(redis_url, redis_prefix):
    """The store's Redis registry appends replace/delete events to the stream workers read."""
    from loraserve.adapter_store.registry import AdapterRecord
    from loraserve.adapter_store.registry_redis import RedisRegistry
    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

    registry, c = RedisRegistry(redis_url, redis_prefix), RedisCoordinator(redis_url, redis_prefix)
    try:

        def record(digest: str) -> AdapterRecord:
            return AdapterRecord("a", "a", digest, 8, 16.0, False, ["q_proj"], "bfloat16", 10, "", 1, 2)

        registry.put(record("d1"), overwrite=False)
        registry.put(record("d2"), overwrite=True)
        registry.delete("a")
        events = c.read_invalidations(FIRST_EVENT_ID)
        assert [(e.adapter_id, e.digest, e.reason) for e in events] == [
            ("a", "d2", "registered"),
            ("a", "", "deleted"),
        ]
        assert c.read_invalidations(events[0].event_id)[0].reason == "deleted"
    finally:
        registry.close()
        c.close()


def test_redis_outage_degrades_to_local_state():
    """No Redis answering: the coordinator serves from its local state and raises nothing
    (republishing once Redis is back: tests/test_redis_outage.py, against a real server)."""
    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

    down = RedisCoordinator("redis://127.0.0.1:1/15", "loraserve-test-down:", backoff_s=0.05)
    try:
        t1 = down.tick()
        down.put_residency(Residency("w1", "a", "d", "gpu", 0, t1))
        down.set_pin("w1", "a", True)
        assert down.tick() > t1 and down.pins("w1") == {"a"}
        assert [r.adapter_id for r in down.residencies("w1")] == ["a"]
    finally:
        down.close()


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")
def test_a_redis_that_lost_its_data_gets_this_process_state_back(tmp_path) -> None:
    """FLUSHALL (as a restart with no persistence): no call fails, so only the epoch tells; the
    next epoch() republishes the residency and pins and raises the cluster clock back."""
    import redis

    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator
    from tests.helpers.private_redis import PrivateRedis

    server = PrivateRedis(tmp_path, ("--save", "", "--appendonly", "no"))
    server.start()
    c = RedisCoordinator(server.url, "loraserve-lost:")
    direct = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        epoch = c.epoch()
        for _ in range(5):
            last = c.tick()
        c.put_residency(Residency("w1", "a", "d1", "gpu", 0, last))
        c.put_residency(Residency("w1", "b", "d2", "cpu", -1, last))
        c.drop_residency("w1", "b")
        c.set_pin("w1", "a", True)
        direct.flushall()
        assert c.residencies("w1") == [] and c.pins("w1") == set()  # nothing tells, yet

        assert c.epoch() not in ("", epoch)
        assert [(r.adapter_id, r.last_used) for r in c.residencies("w1")] == [("a", last)]
        assert c.pins("w1") == {"a"}
        assert int(direct.get("loraserve-lost:clock")) == last and c.tick() == last + 1
        assert c.epoch() == c.epoch()  # told once
    finally:
        direct.close()
        c.close()
        server.stop()
