"""The CPU cache (LRU by count and by bytes, rebuild on miss, digest re-check, no stale payload put
back after a delete) and single flight. Tests of rebuilds turn the disk tier off (cache_dir="")
unless they check what reaches it; test_disk_tier.py covers the tier."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.adapter_store.cache import AdapterCache
from loraserve.adapter_store.disk_tier import DiskTier
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.adapter_store.payload_file import PayloadKey
from loraserve.adapter_store.registry import AdapterRecord
from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2_grpc
from tests.helpers import bad_checkpoints as bad
from tests.helpers.store_calls import expect_error, register


def _value(store, name: str, labels: dict | None = None) -> float:
    return store.service.metrics.value(name, labels)


def test_eviction_by_count_then_refetch(start_store) -> None:
    store = start_store(cache_max_adapters=2, cache_dir="")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        infos = {n: register(stub, n, n) for n in ("peft-qv-r8", "peft-patterns", "peft-subset-layer1")}
        assert _value(store, "loraserve_store_cache_evictions_total") == 1
        assert "peft-qv-r8" not in store.service.cache and len(store.service.cache) == 2
        assert fetch_adapter(stub, "peft-qv-r8").digest == infos["peft-qv-r8"].digest
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
        assert _value(store, "loraserve_store_cache_misses_total") == 1
        fetch_adapter(stub, "peft-qv-r8")  # now cached again: a hit, no build
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
        assert _value(store, "loraserve_store_cache_hits_total") == 1
        assert "peft-patterns" not in store.service.cache  # the least recently used went


def test_eviction_by_bytes(start_store) -> None:
    store = start_store(cache_max_bytes=12_000, cache_dir="")  # one qv r8 adapter (10 KiB) fits, two do not
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        a = register(stub, "a", "peft-qv-r8")
        register(stub, "b", "peft-qv-r8")
        assert a.size_bytes == 10240 and store.service.cache.bytes == 10240
        assert "a" not in store.service.cache and "b" in store.service.cache
        assert _value(store, "loraserve_store_cache_evictions_total") == 1
        # larger than the whole budget: served, never cached
        big = register(stub, "big", "peft-all-r16-rslora")
        assert "big" not in store.service.cache and "b" in store.service.cache
        for _ in range(2):
            assert fetch_adapter(stub, "big").digest == big.digest
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 2
        assert fetch_adapter(stub, "a").digest == a.digest


def test_changed_source_is_data_loss(start_store, adapter_root: Path) -> None:
    bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "mutable")
    store = start_store(cache_max_adapters=1, cache_dir="")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "mutable", "mutable")
        register(stub, "other", "peft-patterns")  # evicts "mutable"
        name = bad.first_name(adapter_root / "mutable", "lora_B.weight")
        bad.edit_tensors(adapter_root / "mutable", lambda t: t.__setitem__(name, t[name] * 2))
        expect_error(
            lambda: fetch_adapter(stub, "mutable"),
            grpc.StatusCode.DATA_LOSS,
            "'mutable'",
            info.digest,
            "changed since registration",
        )
        assert fetch_adapter(stub, "other").rank == 8
        fixed = register(stub, "mutable", "mutable", overwrite=True)
        assert fixed.digest != info.digest and fetch_adapter(stub, "mutable").digest == fixed.digest


def test_single_flight_registration(start_store) -> None:
    store = start_store()
    service = store.service

    async def many():
        return await asyncio.gather(*[service.register("same", "peft-patterns", False) for _ in range(8)])

    records = store.call(many())
    assert len({r.digest for r in records}) == 1
    assert _value(store, "loraserve_store_builds_total", {"reason": "register"}) == 1
    assert _value(store, "loraserve_store_registrations_total", {"outcome": "ok"}) == 8


@pytest.mark.parametrize("tier", [False, True], ids=["rebuild", "disk"])
def test_single_flight_fetch_after_eviction(start_store, tier: bool) -> None:
    store = start_store() if tier else start_store(cache_dir="")
    service = store.service
    digest = store.call(service.register("x", "peft-all-r16-rslora", False)).digest
    service.cache.drop("x")

    async def many():
        opened = await asyncio.gather(*[service.open_fetch("x", 0, "") for _ in range(8)])
        for o in opened:  # a disk read streams while it fills: wait for it to be checked
            if o.filling is not None:
                await o.filling.verified()
        return [(o.record, o.adapter) for o in opened]

    results = store.call(many())
    assert {o.digest for _, o in results} == {digest}
    assert len({id(o.payload) for _, o in results}) == 1
    # one load for all: a read of the disk tier's file, else a rebuild from the source
    assert _value(store, "loraserve_store_disk_hits_total") == int(tier)
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == int(not tier)
    # callers that looked after the rebuild finished find it cached: hits + misses = 8, one build
    hits, misses = (
        _value(store, "loraserve_store_cache_hits_total"),
        _value(store, "loraserve_store_cache_misses_total"),
    )
    assert hits + misses == 8 and misses >= 1 and len(service.flight) == 0


def test_concurrent_grpc_fetches_share_one_rebuild(start_store) -> None:
    store = start_store(cache_dir="")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-all-r16-rslora")
    store.service.cache.drop("x")

    async def many():
        async with grpc.aio.insecure_channel(store.address) as ch:
            from loraserve.clients.adapter_fetch import fetch_adapter_async

            stub = store_pb2_grpc.AdapterStoreStub(ch)
            return await asyncio.gather(*[fetch_adapter_async(stub, "x") for _ in range(6)])

    fetched = asyncio.run(many())
    assert all(torch.equal(f.buffer, fetched[0].buffer) and f.digest == info.digest for f in fetched)
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
    assert _value(store, "loraserve_store_fetch_bytes_total") == 6 * info.size_bytes


@pytest.mark.parametrize("count,budget", [(1, 1 << 30), (8, 15_000)])
def test_cache_bounds_hold(start_store, count: int, budget: int) -> None:
    store = start_store(cache_max_adapters=count, cache_max_bytes=budget)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        for i in range(4):
            register(stub, f"a{i}", "peft-qv-r8")
            assert len(store.service.cache) <= count and store.service.cache.bytes <= budget
        assert _value(store, "loraserve_store_cache_bytes") == store.service.cache.bytes


def test_registration_queue_is_bounded(start_store) -> None:
    from loraserve.adapter_store.errors import ResourceExhausted

    store = start_store(max_pending_registrations=1)
    service = store.service

    async def two():
        return await asyncio.gather(
            service.register("a", "peft-qv-r8", False),
            service.register("b", "peft-patterns", False),
            return_exceptions=True,
        )

    first, second = store.call(two())
    assert first.adapter_id == "a"
    assert isinstance(second, ResourceExhausted) and "in flight" in second.message
    assert store.call(service.register("b", "peft-patterns", False)).adapter_id == "b"


# -- a payload read before a delete is not cached after it -----------------------------------------
def _payload(digest: str, nbytes: int = 16) -> tuple[OptimizedAdapter, AdapterRecord]:
    adapter = OptimizedAdapter([], torch.zeros(nbytes, dtype=torch.uint8), digest, 4, "bfloat16")
    record = AdapterRecord("x", "src", digest, 4, 8.0, False, ["q_proj"], "bfloat16", nbytes, "", 1, 0)
    return adapter, record


def test_a_put_read_before_a_drop_or_a_later_put_is_refused() -> None:
    cache = AdapterCache(4, 1 << 20)
    old, old_record = _payload("d1")
    before = cache.generation()
    cache.drop("x")  # a delete
    assert not cache.put("x", old, old_record, before) and "x" not in cache
    assert cache.put("x", old, old_record, cache.generation()) and "x" in cache  # read after it
    new, new_record = _payload("d2")
    stale = cache.generation()
    assert cache.put("x", new, new_record, cache.generation())  # a re-registration, read later
    assert not cache.put("x", old, old_record, stale)
    assert cache.known_record("x") is new_record and cache.get("x", "d2") is new
    assert cache.put("y", old, old_record, stale)  # another adapter's changes do not matter


def test_a_registration_s_put_is_refused_by_a_drop_or_a_registration_only() -> None:
    cache = AdapterCache(4, 1 << 20)
    old, old_record = _payload("d1")
    new, new_record = _payload("d2")
    read = cache.generation()  # a fetch reads the record that a registration replaces
    written = cache.generation()  # the registration writes the registry
    assert cache.put("x", old, old_record, read)  # the fetch's put lands meanwhile
    assert cache.put("x", new, new_record, written, registered=True)
    assert cache.get("x", "d2") is new and not cache.put("x", old, old_record, read)
    before = cache.generation()
    cache.drop("x")
    assert not cache.put("x", new, new_record, before, registered=True)
    before = cache.generation()
    assert cache.put("x", old, old_record, cache.generation(), registered=True)  # registered anew
    assert not cache.put("x", new, new_record, before, registered=True)


def test_the_history_of_changes_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr("loraserve.adapter_store.cache.MAX_CHANGES", 3)
    cache = AdapterCache(2, 1 << 20)
    payload, record = _payload("d1")
    early = cache.generation()
    for i in range(5):
        cache.drop(f"gone-{i}")
    assert len(cache._changes) == 3
    # "x" changed before the history forgot: a put read that early may be stale, so it is refused
    assert not cache.put("x", payload, record, early)
    assert cache.put("x", payload, record, cache.generation())


def _registered_on_source_only(start_store, tier: Path, monkeypatch):
    """A store with its disk tier in `tier` and `x` registered, then out of its CPU cache and disk
    tier (a fetch rebuilds it), rebuilds held (`_hold_rebuilds`); -> (store, x's record, (held, go))."""
    store = start_store(cache_dir=str(tier))
    service = store.service
    old = store.call(service.register("x", "peft-qv-r8", False))
    service.cache.drop("x")
    service.tier.discard("x")
    service.tier.flush()
    return store, old, _hold_rebuilds(service, monkeypatch)


def _hold_rebuilds(service, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Rebuilds from the source wait for `go` once they have started (`held` set)."""
    held, go = threading.Event(), threading.Event()
    build = service._build

    def held_build(source, reason: str):
        if reason == "rebuild":
            held.set()
            assert go.wait(10), "the test never let the rebuild go on"
        return build(source, reason)

    monkeypatch.setattr(service, "_build", held_build)
    return held, go


@pytest.mark.parametrize("again", [None, "peft-qv-r8", "peft-patterns"], ids=["deleted", "same", "other"])
def test_a_rebuild_in_flight_brings_no_deleted_adapter_back(
    start_store, tmp_path: Path, monkeypatch, again: str | None
) -> None:
    """A fetch reads the record, its rebuild is held, the adapter is deleted (and registered again,
    from the same source or another): the rebuild's payload reaches neither the CPU cache nor the
    disk tier, whatever the fetch streams of the record it read."""
    tier = tmp_path / "tier"
    store, old, (held, go) = _registered_on_source_only(start_store, tier, monkeypatch)
    service = store.service

    async def race():
        fetch = asyncio.ensure_future(service.open_fetch("x", 0, ""))
        assert await asyncio.to_thread(held.wait, 10)
        await service.delete("x")
        new = await service.register("x", again, False) if again else None
        go.set()
        return await fetch, new

    opened, new = store.call(race())
    assert opened.adapter.digest == old.digest  # it read the record before the delete
    service.tier.flush()
    if new is None:
        assert "x" not in service.cache and not list(tier.iterdir())
    else:
        assert service.cache.known_record("x") == new and service.cache.get("x", new.digest) is not None
        assert [p.name for p in tier.iterdir()] == [PayloadKey("x", new.digest).file_name]


def test_a_disk_read_in_flight_brings_no_deleted_adapter_back(
    start_store, tmp_path: Path, monkeypatch
) -> None:
    tier = tmp_path / "tier"
    store = start_store(cache_dir=str(tier))
    service = store.service
    store.call(service.register("x", "peft-all-r16-rslora", False))
    service.cache.drop("x")  # on disk only
    held, go = threading.Event(), threading.Event()
    read = DiskTier.read

    def held_read(self, reader, *rest):
        held.set()
        assert go.wait(10), "the test never let the read go on"
        return read(self, reader, *rest)

    monkeypatch.setattr(DiskTier, "read", held_read)

    async def race():
        opened = await service.open_fetch("x", 0, "")
        assert opened.filling is not None and await asyncio.to_thread(held.wait, 10)
        await service.delete("x")
        await asyncio.to_thread(service.tier.flush)  # the file is gone; the open reader reads on
        go.set()
        await opened.filling.verified()

    store.call(race())
    service.tier.flush()
    assert "x" not in service.cache and not list(tier.iterdir())


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_a_delete_between_a_registration_and_its_caching_wins(
    start_store, tmp_path: Path, monkeypatch
) -> None:
    """The registry holds the record; a delete runs before the registration caches its payload
    and writes it to the disk tier: neither is done afterwards."""
    tier = tmp_path / "tier"
    store = start_store(cache_dir=str(tier))
    service = store.service
    put = service.registry.put
    loop = store.call(_running_loop())

    def put_then_delete(record, overwrite):
        old = put(record, overwrite)
        asyncio.run_coroutine_threadsafe(service.delete(record.adapter_id), loop).result(10)
        return old

    monkeypatch.setattr(service.registry, "put", put_then_delete)
    record = store.call(service.register("x", "peft-qv-r8", False))
    assert record.adapter_id == "x"
    service.tier.flush()
    assert "x" not in service.cache and not list(tier.iterdir())


def test_a_read_put_while_a_registration_writes_the_registry_does_not_keep_it_out(
    start_store, tmp_path: Path, monkeypatch
) -> None:
    """A fetch read the record a re-registration replaces, and puts its payload while the
    registration writes the registry: the registration's payload, put after it, is cached and
    written to the disk tier all the same, not the replaced one (which would be served under its
    old record while the registry is unreachable)."""
    tier = tmp_path / "tier"
    store, old, (held, go) = _registered_on_source_only(start_store, tier, monkeypatch)
    service = store.service
    put = service.registry.put
    loop = store.call(_running_loop())
    fetch: list[asyncio.Future] = []

    async def fetched():
        return await fetch[0]

    def put_then_the_fetch_ends(record, overwrite):
        replaced = put(record, overwrite)
        go.set()
        assert asyncio.run_coroutine_threadsafe(fetched(), loop).result(10).adapter.digest == old.digest
        return replaced

    async def race():
        fetch.append(asyncio.ensure_future(service.open_fetch("x", 0, "")))
        assert await asyncio.to_thread(held.wait, 10)  # it read the record of peft-qv-r8
        monkeypatch.setattr(service.registry, "put", put_then_the_fetch_ends)
        return await service.register("x", "peft-patterns", True)

    new = store.call(race())
    assert new.digest != old.digest
    service.tier.flush()
    assert service.cache.known_record("x") == new and service.cache.get("x", new.digest) is not None
    assert [p.name for p in tier.iterdir()] == [PayloadKey("x", new.digest).file_name]
