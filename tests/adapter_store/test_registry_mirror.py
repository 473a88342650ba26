"""The Redis registry's copy (MirroredRegistry) against a private redis-server that FLUSHALL
empties: what Redis lost is put back from the copy, deletions stay deleted, the last writes that a
Redis lost with its epoch kept are put back too, two stores on one Redis converge, a copy made
under another key prefix is not put back, and a copy that cannot be written fails no call."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.adapter_store.errors import AlreadyExists
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.registry import SqliteRegistry
from loraserve.adapter_store.registry_mirror import MirroredRegistry
from loraserve.adapter_store.registry_redis import RedisRegistry, RegistryLost
from tests.adapter_store.test_registry import _record
from tests.helpers.private_redis import PrivateRedis

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary"),
]
PREFIX = "loraserve-mirror:"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    s = PrivateRedis(tmp_path_factory.mktemp("redis"), ("--save", "", "--appendonly", "no"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server: PrivateRedis):
    import redis

    c = redis.Redis.from_url(server.url, decode_responses=True)
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def open_mirror(server: PrivateRedis, client, tmp_path: Path):
    """open_mirror(name, prefix) -> a MirroredRegistry whose copy is the file `name` (watch thread
    idle: the tests call check())."""
    opened: list[MirroredRegistry] = []

    def open_(name: str = "copy", prefix: str = PREFIX) -> MirroredRegistry:
        m = MirroredRegistry(
            RedisRegistry(server.url, prefix, adopt=False),
            SqliteRegistry(tmp_path / f"{name}.sqlite3"),
            watch_s=3600,
            metrics=StoreMetrics(),
        )
        opened.append(m)
        return m

    yield open_
    for m in opened:
        m.close()


def _ids(registry) -> list[str]:
    return [r.adapter_id for r in registry.list("", 100)[0]]


def test_a_flushed_registry_is_put_back_from_the_copy(open_mirror, client) -> None:
    m = open_mirror()
    for i in "abc":
        m.put(_record(i, i * 64), overwrite=False)
    m.put(_record("b", "e" * 64), overwrite=True)
    assert m.delete("c").adapter_id == "c"
    epoch = client.get(PREFIX + "epoch")

    assert m.metrics is not None and m.metrics.value("loraserve_store_registry_restores_total") == 0
    client.flushall()
    assert m.get("b").digest == "e" * 64  # the first call after the loss reads the restored registry
    assert _ids(m) == ["a", "b"] and m.list("", 100)[2] == 2
    assert m.metrics.value("loraserve_store_registry_restores_total", {"outcome": "from_copy"}) == 1
    assert m.metrics.value("loraserve_store_registry_restored_adapters_total") == 2
    assert client.get(PREFIX + "epoch") not in (None, epoch)
    with pytest.raises(AlreadyExists):
        m.put(_record("a", "f" * 64), overwrite=False)

    client.flushall()
    assert m.delete("a").adapter_id == "a"  # a deletion right after a loss is honoured
    assert m.delete("a") is None
    client.flushall()
    m.check()  # as the watch thread does, with no call at all
    assert client.zrange(PREFIX + "adapters", 0, -1) == ["b"]


def test_a_store_restarted_after_the_loss_restores_the_registry(open_mirror, client) -> None:
    m = open_mirror()
    m.put(_record("a"), overwrite=False)
    m.close()
    client.flushall()
    assert _ids(open_mirror()) == ["a"]


def test_a_copy_of_another_prefix_is_not_put_back(open_mirror, client) -> None:
    m = open_mirror()
    m.put(_record("a"), overwrite=False)
    m.close()
    client.flushall()
    other = open_mirror(prefix="loraserve-other:")
    assert _ids(other) == [] and client.keys("loraserve-other:adapter*") == []
    other.put(_record("b"), overwrite=False)
    other.close()
    client.flushall()
    assert _ids(open_mirror(prefix="loraserve-other:")) == ["b"]  # now it is that prefix's copy


def test_writes_lost_with_the_epoch_kept_are_put_back(open_mirror, client) -> None:
    """Redis comes back from a file that lacks the last writes (an append-only file fsynced every
    second, an older snapshot): same epoch, a version below the copy's."""
    m = open_mirror()
    m.put(_record("a"), overwrite=False)
    m.put(_record("b"), overwrite=False)
    client.delete(PREFIX + "adapter:b")
    client.zrem(PREFIX + "adapters", "b")
    client.decr(PREFIX + "registry:version")
    m.check()
    assert _ids(m) == ["a", "b"]


def test_two_stores_on_one_redis_converge_on_the_registry(open_mirror, client) -> None:
    one, two = open_mirror("one"), open_mirror("two")
    one.put(_record("a"), overwrite=False)
    one.put(_record("b"), overwrite=False)
    two.put(_record("c"), overwrite=False)
    assert two.delete("a") is not None  # the other store's deletion
    one.check()  # the watch thread's round: the copy follows the other store's writes
    client.flushall()
    assert _ids(one) == ["b", "c"]  # "a" stays deleted
    two.put(_record("d"), overwrite=False)
    client.flushall()
    one.check()
    two.check()  # each puts back what it holds: the union
    assert _ids(one) == ["b", "c", "d"] == _ids(two)


def test_a_copy_that_cannot_be_written_fails_no_call(open_mirror, client) -> None:
    m = open_mirror()
    m.put(_record("a"), overwrite=False)
    m.copy.close()  # every write to the copy now fails
    m.put(_record("b"), overwrite=False)
    assert m.delete("a") is not None and _ids(m) == ["b"]
    m.check()
    assert _ids(m) == ["b"]


def test_a_registry_with_no_copy_answers_unavailable_once_lost(server: PrivateRedis, client) -> None:
    reg = RedisRegistry(server.url, PREFIX)  # adopts the epoch it finds at first use
    try:
        reg.put(_record("a"), overwrite=False)
        client.flushall()
        for call in (lambda: reg.get("a"), lambda: reg.list("", 10), lambda: reg.delete("a")):
            with pytest.raises(RegistryLost, match="lost"):
                call()
        with pytest.raises(RegistryLost):
            reg.put(_record("b"), overwrite=False)
        assert client.keys("*") == []  # nothing written to a lost registry
    finally:
        reg.close()


def test_a_deletion_after_the_loss_stays_deleted_with_two_stores(open_mirror, client) -> None:
    """One store restores the registry and an adapter is deleted through it; the other store, whose
    copy knows no more than what was restored, puts nothing back at its next round."""
    one, two = open_mirror("one"), open_mirror("two")
    one.put(_record("a"), overwrite=False)
    one.put(_record("b"), overwrite=False)
    two.check()  # in step
    client.flushall()
    assert one.delete("a") is not None  # the first call after the loss: restored, then deleted
    two.check()
    assert _ids(one) == ["b"] == _ids(two)
    assert [r.adapter_id for r in two.copy.records()] == ["b"]
    assert one.metrics is not None and two.metrics is not None
    assert one.metrics.value("loraserve_store_registry_restores_total", {"outcome": "from_copy"}) == 1
    assert two.metrics.value("loraserve_store_registry_restores_total", {"outcome": "other_store"}) == 1
    assert two.metrics.value("loraserve_store_registry_restored_adapters_total") == 0


def test_a_store_whose_copy_knows_more_still_puts_it_back(open_mirror, client) -> None:
    one, two = open_mirror("one"), open_mirror("two")
    one.put(_record("a"), overwrite=False)
    two.put(_record("b"), overwrite=False)  # not yet in the first store's copy
    client.flushall()
    one.check()
    assert _ids(one) == ["a"]
    two.check()
    one.check()
    assert _ids(one) == ["a", "b"] == [r.adapter_id for r in one.copy.records()]


def test_a_restore_bumps_the_registry_version(open_mirror, client) -> None:
    """What a restore puts back is a registry write: the version moves, so another store whose copy
    is in step with Redis follows it."""
    one = open_mirror("one")
    one.put(_record("a"), overwrite=False)
    client.flushall()
    client.set(PREFIX + "epoch", "another")
    client.set(PREFIX + "registry:version", "5")
    _, before = one.redis.state()
    assert one.redis.restore([_record("a")]) == 1
    assert one.redis.state()[1] == before + 1
    assert one.redis.restore([_record("a")]) == 0  # nothing put back: nothing changed
    assert one.redis.state()[1] == before + 1


def test_a_record_of_the_copy_that_no_longer_parses_is_left_out(open_mirror, client) -> None:
    """A copy written by another version of the store: the records that parse are put back, the
    others are left out (logged), and no call fails for them."""
    import sqlite3

    m = open_mirror()
    for i in "ab":
        m.put(_record(i, i * 64), overwrite=False)
    db = sqlite3.connect(str(m.copy.path))
    db.execute("UPDATE adapters SET record = ? WHERE adapter_id = 'a'", ('{"from": "elsewhere"}',))
    db.commit()
    db.close()
    client.flushall()
    assert m.get("b").digest == "b" * 64
    assert m.get("a") is None and _ids(m) == ["b"]
