"""The hand-written chunk wire form agrees with protobuf both ways, and the channel fetch path
(raw messages) resumes a stream cut by a real client interceptor."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loraserve.clients.adapter_fetch import DataLossError, fetch_adapter, fetch_adapter_async
from loraserve.clients.store_client import StoreClient
from loraserve.contract.chunk_codec import decode_response, encode_chunk
from loraserve.v1 import store_pb2


@pytest.mark.parametrize("offset,size", [(0, 0), (0, 5), (127, 1), (128, 300), (1 << 40, 1 << 20)])
def test_encoding_matches_protobuf(offset: int, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = encode_chunk(offset, memoryview(data))
    theirs = store_pb2.FetchAdapterResponse(
        chunk=store_pb2.DataChunk(offset=offset, data=data)
    ).SerializeToString()
    assert ours == theirs
    parsed = store_pb2.FetchAdapterResponse.FromString(ours)
    assert parsed.chunk.offset == offset and parsed.chunk.data == data
    got_offset, view = decode_response(theirs)
    assert got_offset == offset and bytes(view) == data


def test_manifests_and_odd_messages_go_through_protobuf() -> None:
    manifest = store_pb2.FetchAdapterResponse(manifest=store_pb2.AdapterManifest(digest="ab", total_bytes=3))
    decoded = decode_response(manifest.SerializeToString())
    assert isinstance(decoded, store_pb2.FetchAdapterResponse) and decoded.manifest.digest == "ab"
    with pytest.raises(ValueError, match="past the message"):
        decode_response(b"\x12\x06\x08\x01\x12\x09ab")  # data claims 9 bytes, 2 follow
    with pytest.raises(ValueError, match="corrupt"):
        decode_response(b"\x12\x05\x08\x01\x12\x09ab")  # lengths disagree: protobuf refuses it


class CutAfter(grpc.UnaryStreamClientInterceptor):
    """Cancels the first FetchAdapter call after `n` messages (the client sees the real CANCELLED)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def intercept_unary_stream(self, continuation, details, request):
        call = continuation(details, request)
        self.calls += 1
        if self.calls > 1:
            return call

        def cut():
            for i, msg in enumerate(call):
                if i == self.n:
                    call.cancel()
                yield msg

        return cut()


def test_channel_path_resumes_and_checks(start_store, make_demo) -> None:
    make_demo(
        "big",
        r=16,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    store = start_store(chunk_bytes=4096)
    with StoreClient(store.address) as client:
        info = client.register("big", "big")
        whole = client.fetch("big")
    cutter = CutAfter(7)
    with grpc.intercept_channel(grpc.insecure_channel(store.address), cutter) as channel:
        fetched = fetch_adapter(channel, "big")
    assert cutter.calls == 2 and fetched.digest == info.digest
    assert bytes(fetched.buffer.numpy()) == bytes(whole.buffer.numpy())

    async def run():
        async with grpc.aio.insecure_channel(store.address) as ch:
            return await fetch_adapter_async(ch, "big")

    assert asyncio.run(run()).digest == info.digest


def test_preallocated_buffer_and_digest_mismatch(start_store) -> None:
    import torch

    store = start_store()
    with StoreClient(store.address) as client:
        info = client.register("a", "peft-qv-r8")
        staging = torch.zeros(info.size_bytes + 100, dtype=torch.uint8)
        with grpc.insecure_channel(store.address) as ch:
            fetched = fetch_adapter(ch, "a", buffer=staging)
            assert fetched.buffer.data_ptr() == staging.data_ptr() and fetched.digest == info.digest
            from loraserve.clients.adapter_fetch import AdapterDownload

            download = AdapterDownload("a")
            for raw in ch.unary_stream(
                "/loraserve.v1.AdapterStore/FetchAdapter",
                request_serializer=store_pb2.FetchAdapterRequest.SerializeToString,
            )(download.request()):
                download.on_raw(raw)
            download.manifest.digest = "f" * 64  # what arrived differs from what the manifest promises
            with pytest.raises(DataLossError, match="does not match the manifest digest"):
                download.finish()
