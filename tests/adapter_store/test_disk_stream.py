"""A payload read from the disk tier streams while it is read (adapter_store/filling.py), through a
real store on port 0 and real files: the first chunks leave before the read ends, the stream ends
only once the payload is checked, concurrent fetches share one read, and a copy found damaged after
bytes were sent makes the client fetch again from offset 0 and get the rebuilt payload."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.adapter_store import payload_file
from loraserve.adapter_store.disk_tier import DiskTier
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.adapter_store.payload_file import PayloadKey
from loraserve.clients.adapter_fetch import FETCH_METHOD, fetch_adapter, fetch_adapter_async
from loraserve.contract.chunk_codec import decode_response
from loraserve.contract.payload import PayloadTensor
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.store_calls import register

CHUNK = 4096


def _value(store, name: str, labels: dict | None = None) -> float:
    return store.service.metrics.value(name, labels)


@pytest.fixture
def evicted(start_store, tmp_path, monkeypatch):
    """A store whose CPU cache holds one adapter, `x` (peft-all-r16-rslora) on disk only; reads
    step through the file in 4 KiB and chunks are 4 KiB, so a payload is many of each."""
    monkeypatch.setattr(payload_file, "READ_STEP", CHUNK)
    tier = tmp_path / "tier"
    store = start_store(cache_max_adapters=1, cache_dir=str(tier), chunk_bytes=CHUNK)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "x", "peft-all-r16-rslora")
        reference = fetch_adapter(stub, "x")
        register(stub, "y", "peft-qv-r8")  # evicts x from memory
    store.service.tier.flush()
    assert info.size_bytes > 8 * CHUNK and "x" not in store.service.cache
    return store, info, reference, tier / PayloadKey("x", info.digest).file_name


def _hold_read_at(monkeypatch, at: int) -> tuple[threading.Event, threading.Event]:
    """Disk reads stop once `at` bytes are read until `go` is set; `held` is set when one stops."""
    held, go = threading.Event(), threading.Event()
    real = DiskTier.read

    def read(self, reader, progress=None, *rest):
        def step(done: int) -> None:
            if progress is not None:
                progress(done)
            if done >= at and not go.is_set():
                held.set()
                assert go.wait(10), "the test never let the read go on"

        return real(self, reader, step, *rest)

    monkeypatch.setattr(DiskTier, "read", read)
    return held, go


def test_chunks_stream_while_the_file_is_read(evicted, monkeypatch) -> None:
    store, info, reference, _ = evicted
    held, go = _hold_read_at(monkeypatch, info.size_bytes // 2)
    with grpc.insecure_channel(store.address) as ch:
        call = ch.unary_stream(
            FETCH_METHOD,
            request_serializer=store_pb2.FetchAdapterRequest.SerializeToString,
            response_deserializer=None,
        )(store_pb2.FetchAdapterRequest(adapter_id="x"), timeout=20)
        messages = iter(call)
        manifest = decode_response(next(messages))
        assert isinstance(manifest, store_pb2.FetchAdapterResponse) and manifest.HasField("manifest")
        received = bytearray()
        while len(received) < info.size_bytes // 2:  # half the payload arrives while the read is held
            offset, data = decode_response(next(messages))
            assert offset == len(received)
            received += data
        assert held.is_set() and "x" not in store.service.cache
        go.set()
        for raw in messages:
            offset, data = decode_response(raw)
            assert offset == len(received)
            received += data
    assert bytes(received) == reference.buffer.numpy().tobytes()
    assert "x" in store.service.cache  # checked, then kept in memory
    assert _value(store, "loraserve_store_disk_hits_total") == 1


def test_a_stream_never_ends_before_its_payload_is_checked(evicted, monkeypatch) -> None:
    """Held once every byte is read but before the digest is compared, the read lets every chunk
    go (the client hashes them meanwhile) and keeps the stream's end, its status, back: no client
    completes a fetch until the store has checked what it sent."""
    store, info, reference, _ = evicted
    held, go = _hold_read_at(monkeypatch, info.size_bytes)  # all read, the digest not yet compared
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        call = stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="x"), timeout=20)
        got: list[store_pb2.FetchAdapterResponse] = []
        done = threading.Event()

        def receive() -> None:  # one message at a time, so that the test sees them arrive
            for message in call:
                got.append(message)
            done.set()

        threading.Thread(target=receive, daemon=True).start()
        assert held.wait(5)
        deadline = time.monotonic() + 10
        while sum(len(m.chunk.data) for m in list(got)) < info.size_bytes:
            assert time.monotonic() < deadline, "the last chunks never came"
            time.sleep(0.01)
        assert not done.wait(0.3)  # every byte is there, the end of the stream is not
        go.set()
        assert done.wait(10) and call.code() == grpc.StatusCode.OK
    assert b"".join(m.chunk.data for m in got[1:]) == reference.buffer.numpy().tobytes()


def test_a_copy_found_damaged_after_its_last_chunk_went_out_ends_data_loss(evicted, monkeypatch) -> None:
    """Damage found once every chunk has been sent still fails the stream (DATA_LOSS, marked to
    fetch again): the client has every byte of the damaged copy and completes nothing with them."""
    store, info, _, path = evicted
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    held, go = _hold_read_at(monkeypatch, info.size_bytes)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        call = stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="x"), timeout=20)
        got: list[store_pb2.FetchAdapterResponse] = []
        with pytest.raises(grpc.RpcError) as caught:
            for message in call:
                got.append(message)
                if sum(len(m.chunk.data) for m in got) == info.size_bytes:
                    assert held.wait(10)
                    go.set()  # every byte is here: now let the read compare the digest
    assert sum(len(m.chunk.data) for m in got) == info.size_bytes
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert ("loraserve-refetch", "1") in tuple(caught.value.trailing_metadata())
    assert _value(store, "loraserve_store_disk_corrupt_total") == 1


class _CutAtTheEnd:
    """A stub whose first FetchAdapter stream is cancelled once every byte has come, before its
    status (a connection lost there); the read is let go on after the cut."""

    def __init__(self, channel: grpc.Channel, total: int, go: threading.Event) -> None:
        self._stub, self._total, self._go = store_pb2_grpc.AdapterStoreStub(channel), total, go
        self.streams = 0

    def FetchAdapter(self, request, **kwargs):
        self.streams += 1
        call = self._stub.FetchAdapter(request, **kwargs)
        got = request.offset
        for message in call:
            yield message
            got += len(message.chunk.data)
            if self.streams == 1 and got == self._total:
                call.cancel()
                threading.Timer(0.2, self._go.set).start()


@pytest.mark.parametrize("damaged", [False, True], ids=["sound", "damaged"])
def test_a_stream_cut_between_its_last_chunk_and_its_status(evicted, monkeypatch, damaged) -> None:
    """Every byte came but not the status: the client's own digest decides. Bytes of a sound copy
    are the adapter; bytes of a damaged one (the store had not finished checking it) are fetched
    again from offset 0, not a final DATA_LOSS."""
    store, info, reference, path = evicted
    if damaged:
        data = bytearray(path.read_bytes())
        data[-10] ^= 0x01
        path.write_bytes(bytes(data))
    held, go = _hold_read_at(monkeypatch, info.size_bytes)
    with grpc.insecure_channel(store.address) as ch:
        stub = _CutAtTheEnd(ch, info.size_bytes, go)
        fetched = fetch_adapter(stub, "x", max_retries=2, timeout=20)
    assert held.is_set()
    assert fetched.digest == info.digest and bool((fetched.buffer == reference.buffer).all())
    # damaged: again from 0, and again if that stream still met the damaged read
    assert stub.streams >= 2 if damaged else stub.streams == 1


def test_concurrent_fetches_share_one_read(evicted, monkeypatch) -> None:
    store, info, reference, _ = evicted
    held, go = _hold_read_at(monkeypatch, info.size_bytes // 3)

    async def many():
        async with grpc.aio.insecure_channel(store.address) as ch:
            fetches = [asyncio.ensure_future(fetch_adapter_async(ch, "x")) for _ in range(6)]
            await asyncio.to_thread(held.wait, 10)
            await asyncio.sleep(0.2)  # the other fetches join the read in progress
            go.set()
            return await asyncio.gather(*fetches)

    results = store.call(many())
    assert all(bool((r.buffer == reference.buffer).all()) for r in results)
    assert _value(store, "loraserve_store_disk_hits_total") == 1
    assert _value(store, "loraserve_store_fetch_open_seconds_count", {"origin": "disk"}) == 6


def test_a_copy_found_damaged_after_bytes_were_sent_is_fetched_again(evicted) -> None:
    store, info, reference, path = evicted
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # the payload's end: chunks before it have been sent when the read fails
    path.write_bytes(bytes(data))
    with grpc.insecure_channel(store.address) as ch:
        fetched = fetch_adapter(ch, "x", max_retries=1)
    assert fetched.digest == info.digest and bool((fetched.buffer == reference.buffer).all())
    assert _value(store, "loraserve_store_disk_corrupt_total") == 1
    assert _value(store, "loraserve_store_builds_total", {"reason": "rebuild"}) == 1
    assert [
        _value(store, "loraserve_store_fetch_open_seconds_count", {"origin": o}) for o in ("disk", "source")
    ] == [1, 1]
    store.service.tier.flush()  # the damaged file was removed; the rebuild wrote a good one
    payload_file.open_payload(path, PayloadKey("x", info.digest), info.size_bytes).read()


def test_without_retries_the_damage_is_data_loss(evicted) -> None:
    """A client that may not retry sees DATA_LOSS, marked to fetch again; the store stays up."""
    store, info, _, path = evicted
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    with grpc.insecure_channel(store.address) as ch:
        with pytest.raises(grpc.RpcError) as caught:
            fetch_adapter(ch, "x", max_retries=0)
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert ("loraserve-refetch", "1") in tuple(caught.value.trailing_metadata())
        assert fetch_adapter(ch, "x").digest == info.digest  # rebuilt from the source


def test_a_store_stopped_mid_read_stops(evicted, monkeypatch) -> None:
    """Stopping the store while a read is held ends the fetch with an error, not a hang."""
    store, info, _, _ = evicted
    held, go = _hold_read_at(monkeypatch, info.size_bytes // 2)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            with grpc.insecure_channel(store.address) as ch:
                fetch_adapter(ch, "x", max_retries=0, timeout=20)
        except grpc.RpcError as exc:
            errors.append(exc)

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    assert held.wait(10)
    stopper = threading.Thread(target=store.stop, daemon=True)
    stopper.start()
    go.set()
    t.join(20)
    stopper.join(20)
    assert not t.is_alive() and not stopper.is_alive()


def test_payload_reader_reports_progress(tmp_path: Path) -> None:
    """`PayloadReader.read` reports every step and closes its file; a short file is corrupt."""
    payload = torch.arange(20_000, dtype=torch.float16).view(torch.uint8).clone()
    digest = hashlib.sha256(payload.numpy().tobytes()).hexdigest()
    tensor = PayloadTensor("t", (20_000,), "float16", 0, 40_000)
    adapter = OptimizedAdapter([tensor], payload, digest, 8, "float16")
    key = PayloadKey("p", digest)
    payload_file.write_payload(tmp_path, key, adapter)
    seen: list[int] = []
    reader = payload_file.open_payload(tmp_path / key.file_name, key, 40_000)
    got = reader.read(seen.append)
    assert bytes(got.payload.numpy()) == bytes(payload.numpy())
    assert seen == sorted(seen) and seen[-1] == 40_000 and len(seen) == -(-40_000 // payload_file.READ_STEP)
    with open(tmp_path / key.file_name, "r+b") as f:
        f.truncate((tmp_path / key.file_name).stat().st_size - 10)
    with pytest.raises(payload_file.CorruptPayload):
        payload_file.open_payload(tmp_path / key.file_name, key, 40_000)


def test_a_bug_in_the_read_fails_its_fetches_instead_of_hanging_them(evicted, monkeypatch) -> None:
    """Anything unexpected while a disk copy is read ends the fetches following it (INTERNAL),
    at once; the store stays up and the next fetch reads the file again."""
    store, info, reference, _ = evicted
    real = DiskTier.read

    def broken(self, reader, progress=None, *rest):
        if progress is not None:
            progress(CHUNK)  # some bytes were streamed already
        raise RuntimeError("a bug in the read path")

    monkeypatch.setattr(DiskTier, "read", broken)
    with grpc.insecure_channel(store.address) as ch:
        with pytest.raises(grpc.RpcError) as caught:
            fetch_adapter(ch, "x", max_retries=0, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        monkeypatch.setattr(DiskTier, "read", real)
        fetched = fetch_adapter(ch, "x", timeout=10)
    assert fetched.digest == info.digest and bool((fetched.buffer == reference.buffer).all())


def test_a_disk_read_makes_the_chunk_messages_the_fetch_sends(evicted, monkeypatch) -> None:
    """The chunks of a fetch served from the disk tier are the messages the read made beside the
    event loop (the servicer encodes none), byte for byte what encoding the checked payload gives;
    a fetch resumed off the chunk boundaries is encoded by the servicer, and right."""
    from loraserve.adapter_store import servicer

    store, info, reference, _ = evicted
    encoded: list[int] = []
    real_encode = servicer.encode_chunk

    def counting(offset, data):
        encoded.append(offset)
        return real_encode(offset, data)

    monkeypatch.setattr(servicer, "encode_chunk", counting)
    with grpc.insecure_channel(store.address) as ch:
        call = ch.unary_stream(
            FETCH_METHOD, request_serializer=store_pb2.FetchAdapterRequest.SerializeToString
        )
        raws = list(call(store_pb2.FetchAdapterRequest(adapter_id="x"), timeout=20))
        assert encoded == []  # every chunk came from the read
        payload = reference.buffer.numpy().tobytes()
        expected = [real_encode(o, payload[o : o + CHUNK]) for o in range(0, len(payload), CHUNK)]
        assert raws[1:] == expected
        assert "x" in store.service.cache and _value(store, "loraserve_store_disk_hits_total") == 1
        # from memory now: the servicer encodes, from an offset inside a chunk too
        odd = CHUNK + 123
        raws = list(call(store_pb2.FetchAdapterRequest(adapter_id="x", offset=odd), timeout=20))
        assert encoded[0] == odd and len(encoded) == len(raws) - 1
        got = b"".join(bytes(decode_response(r)[1]) for r in raws[1:])
        assert got == payload[odd:]


def test_a_resumed_fetch_during_the_read_is_encoded_where_it_starts(evicted, monkeypatch) -> None:
    """A fetch that joins a disk read at an offset off the read's steps gets its own chunks."""
    store, info, reference, _ = evicted
    held, go = _hold_read_at(monkeypatch, info.size_bytes // 2)
    payload = reference.buffer.numpy().tobytes()
    odd = 3 * CHUNK + 7

    async def both():
        async with grpc.aio.insecure_channel(store.address) as ch:
            first = asyncio.ensure_future(fetch_adapter_async(ch, "x"))
            await asyncio.to_thread(held.wait, 10)
            call = ch.unary_stream(
                FETCH_METHOD, request_serializer=store_pb2.FetchAdapterRequest.SerializeToString
            )
            stream = call(store_pb2.FetchAdapterRequest(adapter_id="x", offset=odd), timeout=20)
            second = asyncio.ensure_future(_collect(stream))
            await asyncio.sleep(0.2)
            go.set()
            return await first, await second

    async def _collect(stream) -> list[bytes]:
        return [raw async for raw in stream]

    first, raws = store.call(both())
    assert bool((first.buffer == reference.buffer).all())
    chunks = [decode_response(r) for r in raws[1:]]
    assert chunks[0][0] == odd and b"".join(bytes(d) for _, d in chunks) == payload[odd:]
    assert _value(store, "loraserve_store_disk_hits_total") == 1


def test_the_manifest_is_built_once_per_version(stub, monkeypatch) -> None:
    """Fetches of one version send the same manifest bytes, built once; re-registered with other
    weights, the adapter's next fetch sends its new manifest."""
    from loraserve.adapter_store import servicer

    built: list[str] = []
    real = servicer.manifest_to_pb

    def counting(record, optimized):
        built.append(optimized.digest)
        return real(record, optimized)

    monkeypatch.setattr(servicer, "manifest_to_pb", counting)
    first = register(stub, "m", "peft-qv-r8")
    a, b = fetch_adapter(stub, "m"), fetch_adapter(stub, "m")
    assert a.manifest == b.manifest and built == [first.digest]
    second = register(stub, "m", "peft-all-r16-rslora", overwrite=True)
    c = fetch_adapter(stub, "m")
    assert second.digest != first.digest and c.digest == second.digest
    assert c.manifest.adapter.digest == second.digest and built == [first.digest, second.digest]
