"""The FetchAdapter client: chunked rebuild, resume after a broken stream, digest check."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading

import grpc
import pytest

from loraserve.clients.adapter_fetch import AdapterDownload, DataLossError, fetch_adapter, fetch_adapter_async
from loraserve.v1 import store_pb2, store_pb2_grpc


@pytest.fixture
def chunked(start_store, make_demo):
    """A store with 4 KiB chunks and one registered all-module adapter (~70 KiB: many chunks)."""
    make_demo(
        "big",
        r=16,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    store = start_store(chunk_bytes=4096)
    channel = grpc.insecure_channel(store.address)
    stub = store_pb2_grpc.AdapterStoreStub(channel)
    info = stub.RegisterAdapter(store_pb2.RegisterAdapterRequest(adapter_id="big", source="big"))
    yield store, stub, info
    channel.close()


class CuttingStub:
    """Passes FetchAdapter through to the real stub, but cancels the real call after `cut_after`
    messages of the first stream (the RpcError the client sees is the real one), and can flip a byte."""

    def __init__(self, stub, cut_after: int | None = None, corrupt: bool = False) -> None:
        self.stub, self.cut_after, self.corrupt = stub, cut_after, corrupt
        self.requests: list[store_pb2.FetchAdapterRequest] = []

    def FetchAdapter(self, request, **kwargs):
        self.requests.append(request)
        call = self.stub.FetchAdapter(request, **kwargs)
        first = len(self.requests) == 1
        for i, msg in enumerate(call):
            if first and self.cut_after is not None and i == self.cut_after:
                call.cancel()
            if self.corrupt and msg.WhichOneof("payload") == "chunk" and i == 2:
                data = bytearray(msg.chunk.data)
                data[0] ^= 0xFF
                msg = store_pb2.FetchAdapterResponse(
                    chunk=store_pb2.DataChunk(offset=msg.chunk.offset, data=bytes(data))
                )
            yield msg


def test_chunks_are_bounded_and_contiguous(chunked) -> None:
    _, stub, info = chunked
    messages = list(stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="big")))
    assert messages[0].WhichOneof("payload") == "manifest"
    chunks = [m.chunk for m in messages[1:]]
    assert len(chunks) == -(-info.size_bytes // 4096)
    assert all(len(c.data) <= 4096 for c in chunks)
    assert b"".join(c.data for c in chunks) and [c.offset for c in chunks] == list(
        range(0, info.size_bytes, 4096)
    )
    assert hashlib.sha256(b"".join(c.data for c in chunks)).hexdigest() == info.digest


def test_server_resumes_from_offset(chunked) -> None:
    _, stub, info = chunked
    full = b"".join(
        m.chunk.data
        for m in stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="big"))
        if m.WhichOneof("payload") == "chunk"
    )
    tail = list(
        stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="big", offset=10000, digest=info.digest))
    )
    assert tail[0].manifest.digest == info.digest
    assert tail[1].chunk.offset == 10000
    assert b"".join(m.chunk.data for m in tail[1:]) == full[10000:]


def test_broken_stream_is_resumed(chunked) -> None:
    _, stub, info = chunked
    cutting = CuttingStub(stub, cut_after=5)
    fetched = fetch_adapter(cutting, "big")
    assert fetched.digest == info.digest
    assert len(cutting.requests) == 2
    assert cutting.requests[1].offset == 5 * 4096 and cutting.requests[1].digest == info.digest
    direct = fetch_adapter(stub, "big")
    assert bytes(fetched.buffer.numpy()) == bytes(direct.buffer.numpy())


def test_explicit_resume_with_a_download(chunked) -> None:
    _, stub, info = chunked
    download = AdapterDownload("big")
    for i, msg in enumerate(stub.FetchAdapter(download.request())):
        download.on_message(msg)
        if i == 3:
            break
    assert download.received == 3 * 4096 and not download.complete
    fetched = fetch_adapter(stub, "big", download=download)
    assert fetched.digest == info.digest


def test_corrupted_chunk_raises_data_loss(chunked) -> None:
    _, stub, info = chunked
    with pytest.raises(DataLossError, match="does not match the manifest digest"):
        fetch_adapter(CuttingStub(stub, corrupt=True), "big")


def test_no_copying_thread_outlives_its_fetch(chunked) -> None:
    """Chunks are copied and hashed on threads beside the receiving one; they end with the fetch,
    whether the fetch succeeded, was resumed, failed its digest or was refused."""
    import threading

    _, stub, info = chunked
    fetch_adapter(CuttingStub(stub, cut_after=5), "big")
    with pytest.raises(DataLossError):
        fetch_adapter(CuttingStub(stub, corrupt=True), "big")
    with pytest.raises(grpc.RpcError):
        fetch_adapter(stub, "big", digest="0" * 64)
    assert not [t for t in threading.enumerate() if t.name in ("adapter-fetch-copy", "adapter-fetch-hash")]


def test_stale_digest_is_refused(chunked) -> None:
    _, stub, _ = chunked
    with pytest.raises(grpc.RpcError) as err:
        fetch_adapter(stub, "big", digest="0" * 64)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "re-registered" in err.value.details()


def test_async_fetch(chunked) -> None:
    store, stub, info = chunked

    async def run():
        async with grpc.aio.insecure_channel(store.address) as channel:
            return await fetch_adapter_async(store_pb2_grpc.AdapterStoreStub(channel), "big")

    fetched = asyncio.run(run())
    assert fetched.digest == info.digest
    assert bytes(fetched.buffer.numpy()) == bytes(fetch_adapter(stub, "big").buffer.numpy())
    assert fetched.tensors["layers.0.qkv.lora_a"].shape == (3, 16, 64)


@pytest.mark.gpu
def test_buffer_is_pinned_with_cuda(chunked) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, stub, _ = chunked
    fetched = fetch_adapter(stub, "big")
    assert fetched.buffer.is_pinned()
    slot = fetched.tensors["layers.0.qkv.lora_a"].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(slot.cpu(), fetched.tensors["layers.0.qkv.lora_a"])


class CuttingProxy:
    """A TCP proxy to the store. Its first connection forwards at most `hold_bytes` from the store,
    then holds the rest until `cut()` breaks it (both sockets shut down: a real broken stream), so the
    client never has the whole stream on it; later connections pass everything through."""

    def __init__(self, target: str, hold_bytes: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.hold_bytes = (host, int(port)), hold_bytes
        self._cut = threading.Event()
        self.sent: list[int] = []  # bytes store -> client, per connection
        self._first: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            index = len(self.sent)
            self.sent.append(0)
            if index == 0:
                self._first = [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, index), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, index: int | None) -> None:
        try:
            while data := src.recv(65536):
                if index == 0 and self.sent[0] + len(data) > self.hold_bytes:
                    head = data[: self.hold_bytes - self.sent[0]]
                    self.sent[0] += len(head)
                    dst.sendall(head)
                    self._cut.wait(30)
                    break
                if index is not None:
                    self.sent[index] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> None:
        """Break the first connection now."""
        self._cut.set()
        for s in self._first:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


class CutAfterChunks(AdapterDownload):
    """A download that breaks the proxy's first connection once it holds `cut_after` bytes, and
    records the offset of every request it makes."""

    def __init__(self, proxy: CuttingProxy, cut_after: int) -> None:
        super().__init__("big")
        self.proxy, self.cut_after, self.offsets = proxy, cut_after, []

    def request(self, digest: str = ""):
        req = super().request(digest)
        self.offsets.append(req.offset)
        return req

    def on_raw(self, raw: bytes) -> None:
        super().on_raw(raw)
        if len(self.offsets) == 1 and self.received >= self.cut_after:
            self.proxy.cut()


def test_async_broken_stream_is_resumed(chunked) -> None:
    store, stub, info = chunked
    proxy = CuttingProxy(store.address, hold_bytes=10 * 4096)
    download = CutAfterChunks(proxy, cut_after=3 * 4096)

    async def run():
        async with grpc.aio.insecure_channel(proxy.address) as channel:
            return await fetch_adapter_async(channel, "big", download=download)

    try:
        fetched = asyncio.run(run())
    finally:
        proxy.close()
    assert fetched.digest == info.digest
    assert len(proxy.sent) == 2  # cut once, resumed on a new connection
    # Resumed from the bytes it held when the connection broke, not from the start.
    assert len(download.offsets) == 2 and download.offsets[1] >= 3 * 4096
    assert proxy.sent[1] < info.size_bytes
    assert bytes(fetched.buffer.numpy()) == bytes(fetch_adapter(stub, "big").buffer.numpy())


class _EveryByteThenCut:
    """A store stand-in whose every stream sends the manifest and all of the payload (from the
    request's offset), one byte flipped when `damaged`, then fails UNAVAILABLE before its status."""

    class _Cut(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection lost"

    def __init__(self, payload: bytes, damaged: bool) -> None:
        self.payload, self.damaged, self.streams = payload, damaged, 0

    def FetchAdapter(self, request, **kwargs):
        from loraserve.contract.adapter_layout import LAYOUT_VERSION

        self.streams += 1
        digest = hashlib.sha256(self.payload).hexdigest()
        manifest = store_pb2.AdapterManifest(
            digest=digest, total_bytes=len(self.payload), layout_version=LAYOUT_VERSION
        )
        yield store_pb2.FetchAdapterResponse(manifest=manifest)
        data = bytearray(self.payload)
        if self.damaged:
            data[5] ^= 0x01
        chunk = store_pb2.DataChunk(offset=request.offset, data=bytes(data[request.offset :]))
        yield store_pb2.FetchAdapterResponse(chunk=chunk)
        raise self._Cut()


@pytest.mark.parametrize("max_retries", [0, 1])
def test_every_byte_then_a_cut_is_decided_by_the_digest(max_retries) -> None:
    """Bytes that match the digest are the adapter even when the stream's status never came (also
    on the last attempt); bytes that do not are fetched again while attempts are left, and are
    DATA_LOSS, not the cut's UNAVAILABLE, once none is."""
    import numpy as np

    payload = bytes(range(256)) * 12
    sound = _EveryByteThenCut(payload, damaged=False)
    got = fetch_adapter(sound, "a", max_retries=max_retries, allocate=lambda n: np.zeros(n, np.uint8))
    assert got.digest == hashlib.sha256(payload).hexdigest() and sound.streams == 1
    damaged = _EveryByteThenCut(payload, damaged=True)
    with pytest.raises(DataLossError):
        fetch_adapter(damaged, "a", max_retries=max_retries, allocate=lambda n: np.zeros(n, np.uint8))
    assert damaged.streams == max_retries + 1


def test_a_failed_fetch_leaves_no_cycles(chunked) -> None:
    """A fetch that fails leaves nothing for the garbage collector: neither the call that a sync
    stream raises (itself, from a frame of its own that holds it) nor the fetch's frames (its
    download and buffer) in a reference cycle with the error. The store's answer and a stream broken
    with no retry left, through a channel, a stub and asyncio."""
    from tests.helpers.saved_garbage import garbage, of_worker, saving_garbage

    store, stub, _ = chunked
    channel = grpc.insecure_channel(store.address)

    def ours(o: object) -> bool:
        return of_worker(o) or isinstance(o, grpc.RpcError)

    async def fetch_async() -> None:
        async with grpc.aio.insecure_channel(store.address) as aio:
            with pytest.raises(grpc.RpcError):
                await fetch_adapter_async(aio, "no-such-adapter")

    fetch_adapter(channel, "big")  # (first use)
    with saving_garbage():
        garbage(ours)
        for target in (channel, stub):
            with pytest.raises(grpc.RpcError):
                fetch_adapter(target, "no-such-adapter")
        with pytest.raises(grpc.RpcError):
            fetch_adapter(CuttingStub(stub, cut_after=3), "big", max_retries=0)
        asyncio.run(fetch_async())
        assert garbage(ours) == []
    channel.close()
