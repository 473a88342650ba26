"""The AdapterStore gRPC servicer: protobuf in -> AdapterService -> protobuf out. Domain errors
propagate; the server's error interceptor (loraserve/serving/interceptors.py) makes them statuses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from loraserve.adapter_store.errors import PayloadDamaged
from loraserve.adapter_store.handover import PayloadShape
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.adapter_store.registry import AdapterRecord
from loraserve.adapter_store.service import AdapterService
from loraserve.contract.chunk_codec import REFETCH_KEY, encode_chunk, serialize_response
from loraserve.serving import tracing
from loraserve.serving.access_log import note
from loraserve.v1 import adapter_pb2, store_pb2, store_pb2_grpc


def record_to_pb(r: AdapterRecord) -> adapter_pb2.AdapterInfo:
    created = Timestamp()
    created.FromNanoseconds(int(r.created_at * 1e9))
    return adapter_pb2.AdapterInfo(
        adapter_id=r.adapter_id,
        digest=r.digest,
        rank=r.rank,
        lora_alpha=r.lora_alpha,
        use_rslora=r.use_rslora,
        target_modules=r.target_modules,
        dtype=r.dtype,
        size_bytes=r.size_bytes,
        base_model=r.base_model,
        created_at=created,
        source=r.source,
        layout_version=r.layout_version,
        rank_pattern=r.rank_pattern,
        alpha_pattern=r.alpha_pattern,
        num_tensors=r.num_tensors,
        state=adapter_pb2.AdapterState.Value(f"ADAPTER_STATE_{r.state}"),
    )


def manifest_to_pb(r: AdapterRecord, o: OptimizedAdapter | PayloadShape) -> store_pb2.AdapterManifest:
    return store_pb2.AdapterManifest(
        adapter=record_to_pb(r),
        tensors=[
            store_pb2.TensorEntry(name=t.name, shape=t.shape, dtype=t.dtype, offset=t.offset, nbytes=t.nbytes)
            for t in o.tensors
        ],
        total_bytes=o.total_bytes,
        digest=o.digest,
        layout_version=o.layout_version,
        rank=o.rank,
    )


class AdapterStoreServicer(store_pb2_grpc.AdapterStoreServicer):
    MANIFESTS_KEPT = 256  # serialized manifests of the versions fetched most recently

    def __init__(self, service: AdapterService, chunk_bytes: int) -> None:
        self.service = service
        self.chunk_bytes = chunk_bytes
        self._manifests: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def _manifest(self, record: AdapterRecord, optimized: OptimizedAdapter | PayloadShape) -> bytes:
        """The serialized manifest message of a fetch, built once per version and record: a
        manifest lists every tensor (hundreds), which costs the event loop more to build than a
        chunk does to send."""
        key = (record.to_json(), optimized.digest)
        message = self._manifests.get(key)
        if message is None:
            message = store_pb2.FetchAdapterResponse(
                manifest=manifest_to_pb(record, optimized)
            ).SerializeToString()
            self._manifests[key] = message
            if len(self._manifests) > self.MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        else:
            self._manifests.move_to_end(key)
        return message

    def _handover_manifest(self, record: AdapterRecord, payload: OptimizedAdapter | PayloadShape) -> bytes:
        """The manifest naming the payload's hand-over file: a serialized message merges its fields
        into one parsed before it, so the cached manifest plus one holding only handover_file is it."""
        note(handover=payload.digest[:12])
        return (
            self._manifest(record, payload)
            + store_pb2.FetchAdapterResponse(
                manifest=store_pb2.AdapterManifest(handover_file=payload.digest)
            ).SerializeToString()
        )

    async def RegisterAdapter(self, request, context):
        note(adapter=request.adapter_id)
        record = await self.service.register(request.adapter_id, request.source, request.overwrite)
        return record_to_pb(record)

    async def GetAdapter(self, request, context):
        return record_to_pb(await self.service.get(request.adapter_id))

    async def ListAdapters(self, request, context):
        records, token, total = await self.service.list(request.page_size, request.page_token)
        return store_pb2.ListAdaptersResponse(
            adapters=[record_to_pb(r) for r in records], next_page_token=token, total_count=total
        )

    async def DeleteAdapter(self, request, context):
        note(adapter=request.adapter_id)
        record = await self.service.delete(request.adapter_id)
        return store_pb2.DeleteAdapterResponse(adapter=record_to_pb(record))

    async def FetchAdapter(  # type: ignore[override]  # pre-serialized bytes chunks, see serialize_response
        self, request, context
    ) -> AsyncIterator[store_pb2.FetchAdapterResponse | bytes]:
        note(adapter=request.adapter_id, offset=request.offset)
        attributes = {"loraserve.adapter.id": request.adapter_id, "loraserve.offset": request.offset}
        handover = self.service.handover if request.handover and request.offset == 0 else None
        with tracing.span("store.fetch", attributes) as span:  # cache lookup, or a rebuild on a miss
            since = handover.generation() if handover is not None else 0  # before the record is read
            looked_up = await self.service.fetch_record(request.adapter_id, request.digest)
            record = looked_up[0]
            shape = handover.present(record.digest) if handover is not None else None
            if shape is None:
                opened = await self.service.open_fetch(
                    request.adapter_id, request.offset, request.digest, looked_up
                )
                optimized, filling = opened.adapter, opened.filling
                tracing.annotate({"loraserve.bytes": optimized.total_bytes - request.offset}, span)
            else:  # its file is there: nothing of the payload is read here
                self.service.handed_over_file()
        if shape is not None:
            yield self._handover_manifest(record, shape)
            return
        if handover is not None and filling is None:  # in memory: written now, faster than a stream
            with tracing.span("store.handover", attributes):
                name = await handover.offer(optimized, None, since)
            if name is not None:
                yield self._handover_manifest(record, optimized)
                return
        elif handover is not None:  # read from the disk tier: streamed as it is read, its file
            handover.offer_soon(optimized, filling, since)  # written for the next fetch once it is checked
        note(bytes=optimized.total_bytes - request.offset)
        yield self._manifest(opened.record, optimized)  # a serialized FetchAdapterResponse(manifest=...)
        # The payload stays referenced by `optimized` for the whole stream, even if evicted meanwhile.
        view = memoryview(optimized.payload.numpy())  # type: ignore[arg-type]
        total, step, offset = optimized.total_bytes, self.chunk_bytes, request.offset
        metrics = self.service.metrics
        while offset < total:
            end = min(offset + step, total)
            if filling is not None:  # still read from the disk tier: wait for these bytes
                await _filled(filling.wait(end), context)
            # a serialized FetchAdapterResponse(chunk=...): made by the disk read, else here
            chunk = filling.chunk(offset, end) if filling is not None else None
            yield chunk if chunk is not None else encode_chunk(offset, view[offset:end])
            metrics.fetch_bytes.inc(end - offset)
            offset = end
        if filling is not None:  # the stream ends (OK) only once what it sent is checked
            await _filled(filling.verified(), context)


async def _filled(waiting: Awaitable[None], context: grpc.aio.ServicerContext) -> None:
    """Wait on a disk read (filling.py); once it has found its copy damaged, the client is told
    to fetch again from offset 0 (bytes it received came from that copy)."""
    try:
        await waiting
    except PayloadDamaged:
        context.set_trailing_metadata(((REFETCH_KEY, "1"),))
        raise


def add_to_server(servicer: AdapterStoreServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_AdapterStoreServicer_to_server, except that FetchAdapter's serializer
    lets pre-encoded chunks (loraserve/contract/chunk_codec.py) through untouched."""
    unary: dict[str, tuple[Any, Any]] = {
        "RegisterAdapter": (store_pb2.RegisterAdapterRequest, adapter_pb2.AdapterInfo),
        "GetAdapter": (store_pb2.GetAdapterRequest, adapter_pb2.AdapterInfo),
        "ListAdapters": (store_pb2.ListAdaptersRequest, store_pb2.ListAdaptersResponse),
        "DeleteAdapter": (store_pb2.DeleteAdapterRequest, store_pb2.DeleteAdapterResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=req.FromString,
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in unary.items()
    }
    handlers["FetchAdapter"] = grpc.unary_stream_rpc_method_handler(
        servicer.FetchAdapter,
        request_deserializer=store_pb2.FetchAdapterRequest.FromString,
        response_serializer=serialize_response,
    )
    name = store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
