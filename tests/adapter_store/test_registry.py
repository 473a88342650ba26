"""The registry survives a restart of the store (SQLite file, Redis), and both registries keep
the same contract: atomic put with overwrite, delete, paged listing in id order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.errors import AlreadyExists
from loraserve.adapter_store.registry import AdapterRecord, SqliteRegistry
from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers import bad_checkpoints as bad
from tests.helpers.store_calls import expect_error, register


def _record(adapter_id: str, digest: str = "d" * 64) -> AdapterRecord:
    return AdapterRecord(
        adapter_id=adapter_id,
        source=adapter_id,
        digest=digest,
        rank=8,
        lora_alpha=16.0,
        use_rslora=False,
        target_modules=["q_proj"],
        dtype="bfloat16",
        size_bytes=10,
        base_model="",
        layout_version=1,
        num_tensors=2,
        rank_pattern={"v_proj": 4},
    )


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def registry(request, tmp_path: Path):
    if request.param == "sqlite":
        reg = SqliteRegistry(tmp_path / "r.sqlite3")
    else:
        from loraserve.adapter_store.registry_redis import RedisRegistry

        url = request.getfixturevalue("redis_url")
        reg = RedisRegistry(url, request.getfixturevalue("redis_prefix"))
    yield reg
    reg.close()


def test_registry_contract(registry) -> None:
    assert registry.put(_record("b"), overwrite=False) is None
    with pytest.raises(AlreadyExists, match="'b' already exists"):
        registry.put(_record("b", "e" * 64), overwrite=False)
    old = registry.put(_record("b", "e" * 64), overwrite=True)
    assert old is not None and old.digest == "d" * 64
    assert registry.get("b").digest == "e" * 64 and registry.get("b").rank_pattern == {"v_proj": 4}
    for i in "acdef":
        registry.put(_record(i), overwrite=False)
    page, cursor, total = registry.list("", 4)
    assert [r.adapter_id for r in page] == ["a", "b", "c", "d"] and cursor == "d" and total == 6
    page, cursor, total = registry.list("d", 4)
    assert [r.adapter_id for r in page] == ["e", "f"] and cursor == ""
    assert registry.list("d", 2)[1] == "f" and registry.list("f", 2)[:2] == ([], "")
    assert registry.delete("c").adapter_id == "c" and registry.delete("c") is None
    assert registry.get("c") is None and registry.list("", 10)[2] == 5


@pytest.mark.redis
def test_redis_events_and_prefix(redis_url: str, redis_prefix: str) -> None:
    import redis

    from loraserve.adapter_store.registry_redis import RedisRegistry

    reg = RedisRegistry(redis_url, redis_prefix)
    reg.put(_record("x"), overwrite=False)
    reg.put(_record("x", "f" * 64), overwrite=True)
    reg.delete("x")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    events = [fields for _, fields in client.xrange(f"{redis_prefix}events")]
    assert events == [
        {"event": "replaced", "adapter_id": "x", "digest": "f" * 64},
        {"event": "deleted", "adapter_id": "x"},
    ]
    assert all(k.startswith(redis_prefix) for k in client.scan_iter(match=f"{redis_prefix}*"))
    client.close()
    reg.close()


def _restart_roundtrip(start_store, first: dict, second: dict) -> None:
    store = start_store(**first)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        infos = {n: register(stub, n, n) for n in ("peft-qv-r8", "peft-patterns")}
    store.stop()
    store = start_store(**second)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        listed = stub.ListAdapters(store_pb2.ListAdaptersRequest())
        assert [a.adapter_id for a in listed.adapters] == sorted(infos)
        for name, info in infos.items():
            assert stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id=name)) == info
            # the disk tier's file (same data dir) or a rebuild from the source (a new one)
            assert fetch_adapter(stub, name).digest == info.digest


def test_sqlite_registry_survives_restart(start_store) -> None:
    _restart_roundtrip(start_store, {}, {})


@pytest.mark.redis
def test_redis_registry_survives_restart(
    start_store, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    cfg = {"redis_url": redis_url, "redis_prefix": redis_prefix}
    # a different data dir the second time: the adapters can only come from Redis
    _restart_roundtrip(
        start_store, {**cfg, "data_dir": str(tmp_path / "one")}, {**cfg, "data_dir": str(tmp_path / "two")}
    )


def test_redis_unreachable_is_unavailable() -> None:
    from loraserve.adapter_store.errors import Unavailable
    from loraserve.adapter_store.registry_redis import RedisRegistry
    from tests.helpers.ports import free_port

    reg = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", "loraserve-test:")
    with pytest.raises(Unavailable, match="registry \\(Redis\\) unreachable"):
        reg.get("x")
    reg.close()


def _delete_while_listed(monkeypatch, registry, victims: list[str]) -> None:
    """Another store deletes `victims` between the Redis registry's read of the ids (ZRANGEBYLEX)
    and its read of their records (MGET). `registry`: a RedisRegistry or a store's MirroredRegistry."""
    redis_registry = getattr(registry, "redis", registry)
    read_records = redis_registry._read_records

    def racing_read(ids, epoch):
        for victim in victims:
            registry.delete(victim)
        victims.clear()
        return read_records(ids, epoch)

    monkeypatch.setattr(redis_registry, "_read_records", racing_read)


def _ids(records: list[AdapterRecord]) -> list[str]:
    return [r.adapter_id for r in records]


@pytest.mark.redis
def test_ids_deleted_while_listed_do_not_end_the_listing(
    redis_url: str, redis_prefix: str, monkeypatch
) -> None:
    from loraserve.adapter_store.disk_tier import DiskTier
    from loraserve.adapter_store.metrics import StoreMetrics
    from loraserve.adapter_store.registry_redis import RedisRegistry

    reg = RedisRegistry(redis_url, redis_prefix)
    for i in "abcdef":
        reg.put(_record(i, i * 64), overwrite=False)
    _delete_while_listed(monkeypatch, reg, ["a"])
    page, cursor, _ = reg.list("", 2)
    assert _ids(page) == ["b"] and cursor == "b"  # short, and the cursor goes on past "a"
    assert _ids(reg.list(cursor, 10)[0]) == ["c", "d", "e", "f"]

    # the disk tier's start-up sweep keeps the files of every adapter after a short page
    monkeypatch.setattr("loraserve.adapter_store.disk_tier.REGISTRY_PAGE", 2)
    _delete_while_listed(monkeypatch, reg, ["b"])
    tier = DiskTier(Path("/nonexistent"), 1 << 20, StoreMetrics())
    assert tier._registered_digests(reg) == {i: i * 64 for i in "cdef"}
    reg.close()


@pytest.mark.redis
def test_a_listing_page_is_full_though_ids_were_deleted_while_listed(
    start_store, redis_url: str, redis_prefix: str, monkeypatch
) -> None:
    store = start_store(redis_url=redis_url, redis_prefix=redis_prefix)
    registry = store.service.registry
    for i in "abcdef":
        registry.put(_record(i), overwrite=False)
    _delete_while_listed(monkeypatch, registry, ["a", "b"])
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        first = stub.ListAdapters(store_pb2.ListAdaptersRequest(page_size=2))
        assert [a.adapter_id for a in first.adapters] == ["c", "d"] and first.next_page_token
        req = store_pb2.ListAdaptersRequest(page_size=2, page_token=first.next_page_token)
        second = stub.ListAdapters(req)
        assert [a.adapter_id for a in second.adapters] == ["e", "f"] and not second.next_page_token


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def registry_store(request, start_store):
    """A store on either registry."""
    if request.param == "sqlite":
        return start_store()
    return start_store(
        redis_url=request.getfixturevalue("redis_url"), redis_prefix=request.getfixturevalue("redis_prefix")
    )


def test_a_registration_sent_again_answers_its_own_record(registry_store, adapter_root: Path) -> None:
    """A client whose reply was lost sends the same registration again (no overwrite): it gets the
    record its first call wrote, OK, not ALREADY_EXISTS; another source, or a checkpoint there that
    no longer makes the same record, is still ALREADY_EXISTS."""
    bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "mutable")
    with grpc.insecure_channel(registry_store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        first = register(stub, "x", "peft-qv-r8")
        assert register(stub, "x", "peft-qv-r8") == first  # the same record: its created_at too
        assert register(stub, "x", "./peft-qv-r8/") == first  # the same source, spelled otherwise
        expect_error(
            lambda: register(stub, "x", "peft-patterns"),
            grpc.StatusCode.ALREADY_EXISTS,
            "'x' already exists",
            "from 'peft-qv-r8'",
            "overwrite",
        )
        m = register(stub, "m", "mutable")

        def halve_b(tensors: dict) -> None:
            for name in tensors:
                if name.endswith("lora_B.weight"):
                    tensors[name] = tensors[name] / 2

        # twice the alpha, half of B: the same payload (digest), not the same record
        bad.edit_config(adapter_root / "mutable", lora_alpha=32)
        bad.edit_tensors(adapter_root / "mutable", halve_b)
        expect_error(
            lambda: register(stub, "m", "mutable"),
            grpc.StatusCode.ALREADY_EXISTS,
            "'m' already exists",
            "lora_alpha",
        )
        bad.edit_config(adapter_root / "mutable", lora_alpha=16)
        expect_error(
            lambda: register(stub, "m", "mutable"),
            grpc.StatusCode.ALREADY_EXISTS,
            "'m' already exists",
            f"digest {m.digest}",
        )
        assert stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="m")) == m
        assert register(stub, "m", "mutable", overwrite=True).digest != m.digest


def test_registrations_racing_for_one_id_from_one_source_both_succeed(registry_store) -> None:
    """Two spellings of one source are two single flights: the one whose registry write finds the
    other's record answers that record."""
    service = registry_store.service

    async def both():
        return await asyncio.gather(
            service.register("x", "peft-all-r16-rslora", False),
            service.register("x", "./peft-all-r16-rslora", False),
        )

    first, second = registry_store.call(both())
    assert first == second
    assert service.registry.get("x") == first
