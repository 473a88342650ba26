"""Payloads handed over as files on the store's host (adapter_store/handover.py, the client side in
clients/adapter_fetch.py), through a real store on port 0 and real files: the payload arrives whole
and equal to a streamed one, a directory the client does not share falls back to a stream at once,
a store without a hand-over directory streams, the byte bound and deletes remove files, and a
damaged disk-tier copy is never handed over."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.adapter_store import payload_file
from loraserve.adapter_store.handover import HandoverDirectory
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.payload_file import PayloadKey
from loraserve.clients.adapter_fetch import FETCH_METHOD, FetchError, fetch_adapter, fetch_adapter_async
from loraserve.contract.adapter_layout import LAYOUT_VERSION
from loraserve.v1 import adapter_pb2, store_pb2, store_pb2_grpc
from tests.helpers.store_calls import register


def _handovers(store, outcome: str) -> float:
    return store.service.metrics.value("loraserve_store_handovers_total", {"outcome": outcome})


def _written(path: Path) -> None:
    """Wait for the file a registration writes in the background."""
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.01)


def _settled(store) -> None:
    """Wait for the writes the store runs in the background (HandoverDirectory.offer_soon)."""

    async def settled() -> None:
        while store.service.handover._soon:
            await asyncio.sleep(0.01)

    store.call(settled())


def _same(a, b) -> None:
    assert a.digest == b.digest and bytes(a.buffer.numpy()) == bytes(b.buffer.numpy())
    assert a.tensors.keys() == b.tensors.keys()


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    return tmp_path / "handover"


def test_a_fetch_on_the_stores_host_gets_the_payload_as_a_file(start_store, shared):
    store = start_store(handover_dir=str(shared))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-all-r16-rslora")
        _written(shared / info.digest)  # at registration, while the payload is at hand
        streamed = fetch_adapter(ch, "x")
        handed = fetch_adapter(ch, "x", handover_dir=shared)
        again = fetch_adapter(stub, "x", handover_dir=shared, max_retries=0)  # the stub's path too
    assert streamed.handover == "" and handed.handover == "file" and again.handover == "file"
    _same(handed, streamed)
    _same(again, streamed)
    assert (shared / info.digest).stat().st_size == info.size_bytes
    assert _handovers(store, "written") == 1 and _handovers(store, "present") == 2
    assert store.service.metrics.value("loraserve_store_handover_files") == 1


def test_only_fetches_count_as_handed_over(start_store, shared):
    """A registration of a payload whose file is there (another id, the same checkpoint) writes
    nothing and hands nothing over: `present` counts the fetches answered with a file there."""
    store = start_store(handover_dir=str(shared))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-qv-r8")
        _written(shared / info.digest)
        register(stub, "x2", "peft-qv-r8")
        _settled(store)
        assert (_handovers(store, "written"), _handovers(store, "present")) == (1, 0)
        assert fetch_adapter(ch, "x2", handover_dir=shared).handover == "file"
    assert (_handovers(store, "written"), _handovers(store, "present")) == (1, 1)


def test_a_file_there_is_handed_over_without_reading_the_payload(start_store, shared, adapter_root):
    """Out of the CPU cache, no disk tier, its source gone: a stream could not be made (the
    rebuild fails), the file is handed over all the same."""
    store = start_store(handover_dir=str(shared), cache_max_adapters=1, cache_dir="")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-all-r16-rslora")
        reference = fetch_adapter(ch, "x")
        register(stub, "y", "peft-qv-r8")  # evicts x from memory
        _written(shared / info.digest)
        shutil.rmtree(adapter_root / "peft-all-r16-rslora")
        with pytest.raises(grpc.RpcError):
            fetch_adapter(ch, "x", max_retries=0)
        got = fetch_adapter(ch, "x", handover_dir=shared, max_retries=0)
    assert got.handover == "file"
    _same(got, reference)


def test_a_file_the_client_cannot_read_is_streamed_at_once(start_store, shared, tmp_path):
    store = start_store(handover_dir=str(shared))
    elsewhere = tmp_path / "not-shared"
    elsewhere.mkdir()
    with grpc.insecure_channel(store.address) as ch:
        register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-all-r16-rslora")
        reference = fetch_adapter(ch, "x")
        # no retry is spent on the missed file: with none allowed the stream still comes
        missed = fetch_adapter(ch, "x", handover_dir=elsewhere, max_retries=0)
        # a file of the wrong size (not the payload) is not used either
        (elsewhere / reference.digest).write_bytes(b"\0" * 16)
        short = fetch_adapter(ch, "x", handover_dir=elsewhere, max_retries=0)
        # nor a link to the payload's file
        (elsewhere / reference.digest).unlink()
        (elsewhere / reference.digest).symlink_to(shared / reference.digest)
        linked = fetch_adapter(ch, "x", handover_dir=elsewhere, max_retries=0)
    for got in (missed, short, linked):
        assert got.handover == "missed"
        _same(got, reference)


def test_a_store_without_a_handover_directory_streams(start_store, shared):
    store = start_store()
    with grpc.insecure_channel(store.address) as ch:
        register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-qv-r8")
        got = fetch_adapter(ch, "x", handover_dir=shared)
        reference = fetch_adapter(ch, "x")
    assert got.handover == "" and not shared.exists()
    _same(got, reference)


def test_the_async_fetch_takes_a_handover_too(start_store, shared):
    store = start_store(handover_dir=str(shared))
    with grpc.insecure_channel(store.address) as ch:
        register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-patterns")
        reference = fetch_adapter(ch, "x")

    async def fetch():
        async with grpc.aio.insecure_channel(store.address) as ach:
            return await fetch_adapter_async(ach, "x", handover_dir=shared)

    got = asyncio.run(fetch())
    assert got.handover == "file"
    _same(got, reference)


def test_a_handover_file_not_asked_for_breaks_the_contract(start_store, shared):
    """A store answering a plain fetch with a file name is refused, not trusted."""
    store = start_store(handover_dir=str(shared))
    with grpc.insecure_channel(store.address) as ch:
        register(store_pb2_grpc.AdapterStoreStub(ch), "x", "peft-qv-r8")
        fetch_adapter(ch, "x", handover_dir=shared)  # the file is there
        call = ch.unary_stream(
            FETCH_METHOD,
            request_serializer=store_pb2.FetchAdapterRequest.SerializeToString,
            response_deserializer=store_pb2.FetchAdapterResponse.FromString,
        )
        answer = list(call(store_pb2.FetchAdapterRequest(adapter_id="x", handover=True)))
        assert len(answer) == 1 and answer[0].manifest.handover_file == answer[0].manifest.digest

        class Lying:  # the stub of a store that names a file however it was asked
            def FetchAdapter(self, request, **kwargs):
                yield answer[0]

        with pytest.raises(FetchError, match="unasked"):
            fetch_adapter(Lying(), "x", max_retries=0)
        answer[0].manifest.handover_file = "../" + answer[0].manifest.digest
        with pytest.raises(FetchError, match="not named by its digest"):
            fetch_adapter(Lying(), "x", handover_dir=shared, max_retries=0)
        # a path as the digest too: the file there (the payload's, here) is not read unhashed
        inside = shared / "inside"
        inside.mkdir()
        answer[0].manifest.digest = answer[0].manifest.handover_file
        with pytest.raises(FetchError, match="not named by its digest"):
            fetch_adapter(Lying(), "x", handover_dir=inside, max_retries=0)


def test_a_store_that_names_files_after_a_miss_is_refused(tmp_path):
    """After a file it could not read, a fetch asks for a stream: a store that names a file again
    breaks the contract (each such answer was taken as one more miss, retried at once, forever)."""
    manifest = store_pb2.AdapterManifest(
        adapter=adapter_pb2.AdapterInfo(adapter_id="x"),
        total_bytes=16,
        digest="ab" * 32,
        layout_version=LAYOUT_VERSION,
        handover_file="ab" * 32,
    )

    class Insisting:  # names a file that is not there however it was asked
        calls = 0

        def FetchAdapter(self, request, **kwargs):
            self.calls += 1
            if self.calls > 5:
                raise RuntimeError("the fetch goes round and round")
            yield store_pb2.FetchAdapterResponse(manifest=manifest)

    store = Insisting()
    with pytest.raises(FetchError, match="unasked"):
        fetch_adapter(store, "x", handover_dir=tmp_path, max_retries=0, pin_memory=False)
    assert store.calls == 2


def test_deleting_an_adapter_removes_its_file(start_store, shared):
    store = start_store(handover_dir=str(shared))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-qv-r8")
        fetch_adapter(ch, "x", handover_dir=shared)
        assert (shared / info.digest).exists()
        stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="x"))
    assert not (shared / info.digest).exists()
    assert store.service.metrics.value("loraserve_store_handover_files") == 0


def test_the_store_removes_its_files_at_start_and_nothing_else(start_store, shared):
    """What an earlier run left (payload files, a write it did not finish) goes; a file or directory
    of another name is not the store's: a directory given by mistake (/dev/shm, a home) keeps it."""
    shared.mkdir()
    (shared / ("ab" * 32)).write_bytes(b"x")
    (shared / ".writing-abc-1-2").write_bytes(b"x")
    (shared / "someone-elses").write_bytes(b"x")
    (shared / ("cd" * 32)).mkdir()
    start_store(handover_dir=str(shared))
    assert sorted(p.name for p in shared.iterdir()) == ["cd" * 32, "someone-elses"]


def test_a_directory_the_store_makes_is_readable_by_workers_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        HandoverDirectory(tmp_path / "a" / "h", max_bytes=1 << 20, metrics=StoreMetrics()).start()
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "h").stat().st_mode & 0o777 == 0o755


def test_a_directory_that_is_not_the_stores_own_is_refused(tmp_path, monkeypatch):
    """Workers trust the files there by name: the store refuses a directory that others may write
    into (a shared /tmp or /dev/shm), a link, or one of another user, and leaves it as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    left = shared / ("ab" * 32)
    left.write_bytes(b"x")
    directory = HandoverDirectory(shared, max_bytes=1 << 20, metrics=StoreMetrics())
    for mode in (0o1777, 0o775):
        shared.chmod(mode)
        with pytest.raises(ValueError, match="writable by other users"):
            directory.start()
        assert shared.stat().st_mode & 0o7777 == mode and left.exists()
    shared.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(ValueError, match="not a symbolic link"):
        HandoverDirectory(link, max_bytes=1 << 20, metrics=StoreMetrics()).start()
    monkeypatch.setattr(os, "geteuid", lambda: shared.stat().st_uid + 1)
    with pytest.raises(ValueError, match="owned by uid"):
        directory.start()
    assert left.exists()
    monkeypatch.undo()
    directory.start()  # its own, not writable by others: taken as it is
    assert shared.stat().st_mode & 0o7777 == 0o750 and not left.exists()


def test_a_handover_directory_must_be_the_stores_own(store_config, tmp_path):
    root = store_config.adapter_root
    for taken in (store_config.data_dir, root, str(tmp_path), f"{root}/peft-qv-r8", f"{root}/h"):
        with pytest.raises(ValueError, match="handover_dir"):
            store_config.replace(handover_dir=taken)
    store_config.replace(handover_dir=str(tmp_path / "handover"))


def _on_disk_only(start_store, shared: Path, tier: Path):
    """A store with a hand-over directory and a CPU cache of one adapter: `x` registered, then out
    of memory (y registered) and its hand-over file removed, so a fetch reads the disk tier's copy;
    -> (store, x's info, x fetched as a stream)."""
    store = start_store(handover_dir=str(shared), cache_max_adapters=1, cache_dir=str(tier))
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-all-r16-rslora")
        reference = fetch_adapter(ch, "x")
        register(stub, "y", "peft-qv-r8")  # evicts x from memory
    store.service.tier.flush()
    _written(shared / info.digest)
    (shared / info.digest).unlink()
    return store, info, reference


def test_a_damaged_disk_copy_is_not_handed_over(start_store, shared, tmp_path, monkeypatch):
    """The disk tier's read finds its copy damaged: the fetch is told to start again, gets the
    payload rebuilt from the source, and no file of the damaged bytes is ever written."""
    monkeypatch.setattr(payload_file, "READ_STEP", 4096)
    tier = tmp_path / "tier"
    store, info, reference = _on_disk_only(start_store, shared, tier)
    with grpc.insecure_channel(store.address) as ch:
        path = tier / PayloadKey("x", info.digest).file_name
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
        got = fetch_adapter(ch, "x", handover_dir=shared)
    _same(got, reference)
    assert got.handover == "file"  # the refetch, from the rebuilt payload (in memory)
    assert (shared / info.digest).read_bytes() == bytes(reference.buffer.numpy())


def test_a_payload_read_from_the_disk_tier_streams_and_is_written_for_the_next(start_store, shared, tmp_path):
    store, info, reference = _on_disk_only(start_store, shared, tmp_path / "tier")
    with grpc.insecure_channel(store.address) as ch:
        streamed = fetch_adapter(ch, "x", handover_dir=shared)  # a stream beats waiting for the read
        _written(shared / info.digest)
        handed = fetch_adapter(ch, "x", handover_dir=shared)
    assert (streamed.handover, handed.handover) == ("", "file")
    _same(streamed, reference)
    _same(handed, reference)


def _payload(n: int, fill: int):
    from loraserve.adapter_store.optimize import OptimizedAdapter

    data = torch.full((n,), fill, dtype=torch.uint8)
    return OptimizedAdapter(tensors=[], payload=data, digest=f"{fill:064x}", rank=1, dtype="bfloat16")


def test_the_byte_bound_removes_least_recently_handed_over_files(tmp_path):
    directory = HandoverDirectory(tmp_path / "h", max_bytes=3000, metrics=StoreMetrics(), keep_s=0.0)
    directory.start()

    async def run() -> list[str | None]:
        names = [await directory.offer(_payload(1000, i), None, 0) for i in (1, 2, 3)]
        names.append(await directory.offer(_payload(1000, 1), None, 0))  # 1 is now the most recent
        names.append(await directory.offer(_payload(1000, 4), None, 0))  # 2 goes
        return names

    names = asyncio.run(run())
    assert None not in names
    left = sorted(p.name for p in (tmp_path / "h").iterdir())
    assert left == sorted([f"{1:064x}", f"{3:064x}", f"{4:064x}"])
    assert directory.bytes == 3000 and len(directory) == 3


def test_a_payload_over_the_bound_is_streamed_not_written(tmp_path):
    metrics = StoreMetrics()
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1500, metrics=metrics, keep_s=0.0)
    directory.start()

    async def run() -> tuple[str | None, str | None]:
        kept = await directory.offer(_payload(1000, 1), None, 0)
        return kept, await directory.offer(_payload(2000, 2), None, 0)

    kept, big = asyncio.run(run())
    assert kept == f"{1:064x}" and big is None
    assert [p.name for p in (tmp_path / "h").iterdir()] == [kept]  # nothing evicted for it either
    assert metrics.value("loraserve_store_handovers_total", {"outcome": "too_large"}) == 1


def test_files_handed_out_recently_are_kept_past_the_bound(tmp_path):
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1500, metrics=StoreMetrics(), keep_s=60.0)
    directory.start()

    async def run() -> None:
        for i in (1, 2):
            assert await directory.offer(_payload(1000, i), None, 0) is not None

    asyncio.run(run())
    assert len(list((tmp_path / "h").iterdir())) == 2  # both within keep_s: a reader may be opening one


def test_a_file_removed_under_the_store_is_written_again(tmp_path):
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1 << 20, metrics=StoreMetrics())
    directory.start()

    async def run() -> None:
        name = await directory.offer(_payload(100, 7), None, 0)
        assert name is not None
        os.unlink(tmp_path / "h" / name)
        assert await directory.offer(_payload(100, 7), None, 0) == name
        assert (tmp_path / "h" / name).read_bytes() == bytes([7]) * 100

    asyncio.run(run())


def test_files_are_readable_by_workers_whatever_the_umask(tmp_path):
    """Workers may run as another user (containers of one pod): a file they cannot open costs
    every fetch of it a round trip, then a stream."""
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1 << 20, metrics=StoreMetrics())
    directory.start()
    old = os.umask(0o077)
    try:
        name = asyncio.run(directory.offer(_payload(100, 7), None, 0))
    finally:
        os.umask(old)
    assert name is not None and (tmp_path / "h" / name).stat().st_mode & 0o777 == 0o644


def test_a_file_is_not_written_for_a_record_read_before_a_delete(tmp_path, monkeypatch):
    """A fetch read the record, then the adapter was deleted (its file discarded) before the
    fetch's offer, or while its file was written: no file of the deleted adapter is left behind."""
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1 << 20, metrics=StoreMetrics())
    directory.start()
    payload = _payload(100, 7)
    started, release = threading.Event(), threading.Event()
    write = HandoverDirectory._write_file

    def held(self, optimized):
        started.set()
        assert release.wait(10)
        write(self, optimized)

    async def run() -> None:
        since = directory.generation()
        directory.discard(payload.digest)  # deleted after its record was read
        assert await directory.offer(payload, None, since) is None
        monkeypatch.setattr(HandoverDirectory, "_write_file", held)
        since = directory.generation()
        offered = asyncio.ensure_future(directory.offer(payload, None, since))
        await asyncio.to_thread(started.wait, 10)
        directory.discard(payload.digest)  # deleted while its file is written
        release.set()
        assert await offered is None
        # registered again: written
        assert await directory.offer(payload, None, directory.generation()) == payload.digest

    asyncio.run(run())
    assert [p.name for p in (tmp_path / "h").iterdir()] == [payload.digest] and len(directory) == 1


def test_a_delete_during_the_registrations_write_leaves_no_file(start_store, shared, monkeypatch):
    release = threading.Event()
    write = HandoverDirectory._write_file

    def held(self, optimized):
        assert release.wait(10)
        write(self, optimized)

    monkeypatch.setattr(HandoverDirectory, "_write_file", held)
    store = start_store(handover_dir=str(shared))
    handover = store.service.handover
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        register(stub, "x", "peft-qv-r8")  # its file is being written in the background
        stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="x"))
    release.set()
    _settled(store)
    assert list(shared.iterdir()) == [] and len(handover) == 0
    assert store.service.metrics.value("loraserve_store_handover_files") == 0


def test_no_room_streams_instead(tmp_path, monkeypatch):
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1 << 20, metrics=StoreMetrics())
    directory.start()

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)

    async def run() -> str | None:
        return await directory.offer(_payload(100, 7), None, 0)

    assert asyncio.run(run()) is None
    assert list((tmp_path / "h").iterdir()) == [] and directory.bytes == 0


def test_a_directory_it_cannot_write_streams_and_says_so_once_a_minute(tmp_path, monkeypatch, caplog):
    """A read-only or forbidden directory fails every write: each fetch streams, and the log
    says so once a minute, not once a fetch."""
    metrics = StoreMetrics()
    directory = HandoverDirectory(tmp_path / "h", max_bytes=1 << 20, metrics=metrics)
    directory.start()

    def forbidden(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", forbidden)

    async def run() -> list[str | None]:
        return [await directory.offer(_payload(100, i), None, 0) for i in (1, 2, 3)]

    with caplog.at_level("WARNING", logger="loraserve.store.handover"):
        assert asyncio.run(run()) == [None] * 3
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1
    assert metrics.value("loraserve_store_handovers_total", {"outcome": "failed"}) == 3
