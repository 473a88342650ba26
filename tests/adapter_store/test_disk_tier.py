"""The disk tier of optimized payloads, through a real store on port 0 and real files: CPU cache
misses are served from disk without the source, damaged files are caught and rebuilt, stale
versions go, a failing disk fails nothing, the byte bound evicts LRU, restarts keep the tier."""

from __future__ import annotations

import errno
import logging
import shutil
import uuid
from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.payload_file import PayloadKey
from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.store_calls import register

QV_R8 = 10240  # payload bytes of peft-qv-r8 on the tiny model


def _value(store, name: str, labels: dict | None = None) -> float:
    return store.service.metrics.value(name, labels)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def _file(directory: Path, adapter_id: str, digest: str) -> Path:
    return directory / PayloadKey(adapter_id, digest).file_name


def _origin_count(store, origin: str) -> float:
    return _value(store, "loraserve_store_fetch_open_seconds_count", {"origin": origin})


def test_a_miss_is_served_from_disk_without_the_source(start_store, adapter_root: Path, tmp_path) -> None:
    tier = tmp_path / "tier"
    store = start_store(cache_max_adapters=1, cache_dir=str(tier))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-patterns")
        resident = fetch_adapter(stub, "x")  # from memory: the reference manifest and bytes
        assert _file(tier, "x", info.digest).is_file()  # written before RegisterAdapter replied
        register(stub, "y", "peft-qv-r8")  # evicts x from the CPU cache
        shutil.rmtree(adapter_root / "peft-patterns")  # a rebuild could not read the source now
        fetched = fetch_adapter(stub, "x")
        assert fetched.digest == info.digest and bool((fetched.buffer == resident.buffer).all())
        assert fetched.manifest == resident.manifest
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 0
        assert _value(store, "loraserve_store_disk_hits_total") == 1
        assert _value(store, "loraserve_store_disk_read_bytes_total") == info.size_bytes
        assert [_origin_count(store, o) for o in ("memory", "disk", "source")] == [1, 1, 0]
        assert "x" in store.service.cache  # back in memory: the next fetch is a hit
        fetch_adapter(stub, "x")
        assert [_origin_count(store, o) for o in ("memory", "disk", "source")] == [2, 1, 0]


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b'"rank":') + len(b'"rank":')
    data[at] = ord("9") if data[at] != ord("9") else ord("7")  # still valid JSON, another rank
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)


@pytest.mark.parametrize("damage", [_flip_payload_byte, _flip_header_byte, _truncate])
def test_a_damaged_file_is_removed_and_rebuilt(start_store, tmp_path, damage) -> None:
    tier = tmp_path / "tier"
    store = start_store(cache_max_adapters=1, cache_dir=str(tier))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-patterns")
        register(stub, "y", "peft-qv-r8")
        path = _file(tier, "x", info.digest)
        damage(path)
        assert fetch_adapter(stub, "x").digest == info.digest
        assert _value(store, "loraserve_store_disk_corrupt_total") == 1
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
        assert _origin_count(store, "source") == 1
        store.service.tier.flush()  # the rebuild wrote a good file again
        register(stub, "y2", "peft-qv-r8")  # evicts x from memory once more
        assert fetch_adapter(stub, "x").digest == info.digest
        assert _value(store, "loraserve_store_disk_hits_total") == 1
        assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1


def test_reregister_and_delete_drop_stale_files(start_store, tmp_path) -> None:
    tier = tmp_path / "tier"
    store = start_store(cache_max_adapters=1, cache_dir=str(tier))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        old = register(stub, "x", "peft-qv-r8")
        register(stub, "x.y", "peft-qv-r8")  # an id that x's prefix matches textually
        new = register(stub, "x", "peft-patterns", overwrite=True)
        store.service.tier.flush()
        assert new.digest != old.digest
        assert _files(tier) == sorted(
            [_file(tier, "x", new.digest).name, _file(tier, "x.y", old.digest).name]
        )
        register(stub, "z", "peft-qv-r8")  # x leaves memory: its fetch must read the new version
        assert fetch_adapter(stub, "x").digest == new.digest
        stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="x"))
        store.service.tier.flush()
        assert _files(tier) == sorted([_file(tier, n, old.digest).name for n in ("x.y", "z")])


def test_a_tier_that_is_not_a_directory_breaks_nothing(start_store, tmp_path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the tier's directory should be")
    store = start_store(cache_max_adapters=1, cache_dir=str(blocker / "tier"))
    caplog.set_level(logging.WARNING, logger="loraserve.store")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        infos = [register(stub, n, "peft-qv-r8") for n in ("a", "b", "c")]
        assert fetch_adapter(stub, "a").digest == infos[0].digest  # rebuilt from the source
    store.service.tier.flush()
    assert _value(store, "loraserve_store_disk_errors_total", {"op": "write"}) == 4  # a, b, c, a's rebuild
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len([w for w in warnings if " write failed" in w]) == 1, warnings  # logged once


def test_a_full_disk_breaks_nothing_and_recovers(start_store, tmp_path, monkeypatch, caplog) -> None:
    from loraserve.adapter_store import disk_tier, payload_file

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = tmp_path / "tier"
    store = start_store(cache_max_adapters=1, cache_dir=str(tier))
    caplog.set_level(logging.INFO, logger="loraserve.store")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        monkeypatch.setattr(disk_tier, "write_payload", full)
        a = register(stub, "a", "peft-qv-r8")
        register(stub, "b", "peft-patterns")
        assert fetch_adapter(stub, "a").digest == a.digest
        store.service.tier.flush()
        assert _value(store, "loraserve_store_disk_errors_total", {"op": "write"}) == 3  # a, b, a's rebuild
        assert _files(tier) == []
        monkeypatch.setattr(disk_tier, "write_payload", payload_file.write_payload)
        c = register(stub, "c", "peft-all-r16-rslora")
        assert _file(tier, "c", c.digest).is_file()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("No space left" in m for m in messages) == 1
    assert any("write works again" in m for m in messages)


def test_the_byte_bound_evicts_least_recently_used(start_store, tmp_path) -> None:
    tier = tmp_path / "tier"
    bound = 25_000
    store = start_store(cache_max_adapters=1, cache_dir=str(tier), cache_dir_max_bytes=bound)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        a = register(stub, "a", "peft-qv-r8")
        size = _file(tier, "a", a.digest).stat().st_size
        assert a.size_bytes == QV_R8 and 2 * size <= bound < 3 * size
        register(stub, "b", "peft-qv-r8")
        assert fetch_adapter(stub, "a").digest == a.digest  # from disk: a is now used after b
        register(stub, "c", "peft-qv-r8")
        store.service.tier.flush()
        assert _files(tier) == sorted(_file(tier, n, a.digest).name for n in ("a", "c"))
        assert _value(store, "loraserve_store_disk_evictions_total") == 1
        assert _value(store, "loraserve_store_disk_bytes") == 2 * size == store.service.tier.bytes
        # larger than the whole bound: never written, still served
        big = register(stub, "big", "peft-all-r16-rslora")
        assert big.size_bytes > bound and fetch_adapter(stub, "big").digest == big.digest
        store.service.tier.flush()
        assert len(_files(tier)) == 2


def _restart_keeps_the_tier(start_store, adapter_root: Path, tier: Path, first: dict, second: dict) -> None:
    store = start_store(cache_dir=str(tier), **first)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        infos = {n: register(stub, n, n) for n in ("peft-qv-r8", "peft-patterns")}
    store.stop()
    # what a crash, a deletion behind the store's back or another version would leave behind
    kept = _file(tier, "peft-qv-r8", infos["peft-qv-r8"].digest)
    shutil.copy(kept, _file(tier, "ghost", infos["peft-qv-r8"].digest))
    shutil.copy(kept, _file(tier, "peft-patterns", "0" * 64))
    (tier / ".tmp-interrupted").write_bytes(b"half a payload")
    (tier / "README").write_text("not the tier's: left alone")
    for name in infos:
        shutil.rmtree(adapter_root / name)
    store = start_store(cache_dir=str(tier), **second)
    store.service.tier.flush()  # the start-up sweep has run
    assert _files(tier) == sorted(["README", *(_file(tier, n, i.digest).name for n, i in infos.items())])
    assert _value(store, "loraserve_store_disk_orphans_total") == 2
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        for name, info in infos.items():
            assert fetch_adapter(stub, name).digest == info.digest  # from disk: the sources are gone
    assert _value(store, "loraserve_store_disk_hits_total") == 2
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 0


def test_restart_keeps_the_tier_and_removes_orphans(start_store, adapter_root: Path, tmp_path) -> None:
    _restart_keeps_the_tier(start_store, adapter_root, tmp_path / "tier", {}, {})


@pytest.mark.redis
def test_restart_keeps_the_tier_with_redis(
    start_store, adapter_root: Path, tmp_path, redis_url: str, redis_prefix: str
) -> None:
    cfg = {"redis_url": redis_url, "redis_prefix": redis_prefix}
    _restart_keeps_the_tier(
        start_store,
        adapter_root,
        tmp_path / "tier",
        {**cfg, "data_dir": str(tmp_path / "one")},
        {**cfg, "data_dir": str(tmp_path / "two")},
    )


def test_default_tier_lives_in_the_data_dir_and_can_be_off(start_store, tmp_path) -> None:
    store = start_store(data_dir=str(tmp_path / "data"))
    with grpc.insecure_channel(store.address) as ch:
        info = register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-qv-r8")
    assert _file(tmp_path / "data" / "payload-cache", "x", info.digest).is_file()
    off = start_store(data_dir=str(tmp_path / "off"), cache_dir="")
    assert off.service.tier is None
    with grpc.insecure_channel(off.address) as ch:
        register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-qv-r8")
    assert not (tmp_path / "off" / "payload-cache").exists()


@pytest.mark.s3
def test_an_s3_adapter_is_served_from_disk_after_its_objects_are_gone(
    start_store, s3_endpoint: str, s3_bucket: str, peft_root: Path, tmp_path
) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    prefix = f"tier-{uuid.uuid4().hex[:8]}/peft-patterns"
    for f in (peft_root / "peft-patterns").iterdir():
        s3.upload_file(str(f), s3_bucket, f"{prefix}/{f.name}")
    store = start_store(
        s3_endpoint_url=s3_endpoint,
        s3_region="us-east-1",
        cache_max_adapters=1,
        cache_dir=str(tmp_path / "t"),
    )
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "from-s3", f"s3://{s3_bucket}/{prefix}")
        register(stub, "local", "peft-qv-r8")  # evicts from-s3 from memory
        for f in (peft_root / "peft-patterns").iterdir():
            s3.delete_object(Bucket=s3_bucket, Key=f"{prefix}/{f.name}")
        assert fetch_adapter(stub, "from-s3").digest == info.digest
    assert _value(store, "loraserve_store_disk_hits_total") == 1
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 0
