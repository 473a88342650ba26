"""The InferenceWorker servicer: pb -> engine request -> pb, errors mapped by inference_worker.errors."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from loraserve.v1 import worker_pb2, worker_pb2_grpc

from clients.bearer import check_bearer
from inference_worker.config import WorkerConfig
from inference_worker.engine.adapter_hooks import AdapterManager, AdapterState
from inference_worker.engine.engine import LLMEngine
from inference_worker.engine.sequence import FinishReason, RequestOutput, SamplingParams, Usage
from inference_worker.errors import (
    Draining,
    InvalidRequest,
    NoAdapterStore,
    WorkerError,
    grpc_status_code,
)
from inference_worker.metrics import WorkerMetrics

VERSION = "0.1.0"

_FINISH = {
    FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: worker_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: worker_pb2.FINISH_REASON_EOS,
    FinishReason.CANCELLED: worker_pb2.FINISH_REASON_CANCELLED,
}
_TIERS = {"gpu": worker_pb2.ADAPTER_TIER_GPU, "cpu": worker_pb2.ADAPTER_TIER_CPU,
          "loading": worker_pb2.ADAPTER_TIER_LOADING}


def sampling_from_pb(s: worker_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p if s.top_p != 0 else 1.0, seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)


def usage_to_pb(u: Usage) -> worker_pb2.Usage:
    return worker_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            queue_time_ms=u.queue_time_ms, time_to_first_token_ms=u.time_to_first_token_ms,
                            total_time_ms=u.total_time_ms)


def adapter_to_pb(a: AdapterState) -> worker_pb2.WorkerAdapter:
    pb = worker_pb2.WorkerAdapter(
        adapter_id=a.adapter_id, digest=a.digest, tier=_TIERS.get(a.tier, worker_pb2.ADAPTER_TIER_UNSPECIFIED),
        slot=a.slot, pinned=a.pinned, rank=a.rank, size_bytes=a.size_bytes, num_requests=a.num_requests,
        num_tokens=a.num_tokens, num_gpu_loads=a.num_gpu_loads, num_running=a.num_running)
    if a.last_used is not None:
        ts = Timestamp()
        ts.FromNanoseconds(int(a.last_used * 1e9))
        pb.last_used.CopyFrom(ts)
    return pb


def _deliver(items: list) -> None:
    for callback, out in items:
        callback(out)


def dispatch_on(loop: asyncio.AbstractEventLoop):
    """An engine output dispatcher: one thread-safe hand-over per step to `loop`, where each
    request's callback (its queue's put_nowait) runs."""
    return lambda items: loop.call_soon_threadsafe(_deliver, items)


class InferenceWorkerServicer(worker_pb2_grpc.InferenceWorkerServicer):
    def __init__(self, engine: LLMEngine, config: WorkerConfig, metrics: WorkerMetrics,
                 adapters: AdapterManager | None = None) -> None:
        self.engine, self.config, self.metrics, self.adapters = engine, config, metrics, adapters
        self.draining = False
        self.active = 0  # generations in flight

    # -------------------------------------------------------------------------- helpers
    async def _authorize(self, context: grpc.aio.ServicerContext, token: str | None) -> None:
        if not token:
            return
        denied = check_bearer(context.invocation_metadata(), token)
        if denied is not None:
            code, message = denied
            await context.abort(grpc.StatusCode[code], message)

    async def _outputs(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                       method: str) -> AsyncIterator[RequestOutput]:
        """Submits the request and yields its outputs; aborting the sequence if the call goes away."""
        await self._authorize(context, self.config.generate_token)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request.request_id or uuid.uuid4().hex
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        finished = False
        try:
            if self.draining:
                raise Draining("the worker is draining; retry on another worker")
            seq = self.engine.make_sequence(
                rid, request.prompt, list(request.prompt_token_ids), sampling_from_pb(request.sampling),
                queue.put_nowait, request.adapter_id, deadline)
            self.engine.submit(seq)
        except WorkerError as exc:
            self.metrics.requests.labels(method, exc.code).inc()
            await context.abort(grpc_status_code(exc), str(exc))
        self.active += 1
        try:
            while True:
                out = await queue.get()
                if out.finished:
                    finished = True
                    if out.error is not None:
                        code = grpc_status_code(out.error)
                        self.metrics.requests.labels(method, code.name).inc()
                        await context.abort(code, str(out.error) if isinstance(out.error, WorkerError)
                                            else f"generation failed: {out.error!r}")
                    self.metrics.requests.labels(method, "OK").inc()
                    if out.usage is not None:
                        self.metrics.observe_finished(out.usage)
                yield out
                if finished:
                    return
        finally:
            self.active -= 1
            if not finished:
                self.engine.abort(rid)
                self.metrics.requests.labels(method, "CANCELLED").inc()

    # ---------------------------------------------------------------------------- RPCs
    async def Generate(self, request, context):
        rid = request.request_id
        text, token_ids, last = [], [], None
        async with aclosing(self._outputs(request, context, "Generate")) as outs:
            async for out in outs:
                rid = out.request_id
                text.append(out.text)
                token_ids.extend(out.token_ids)
                last = out
        assert last is not None and last.usage is not None and last.finish_reason is not None
        return worker_pb2.GenerateResponse(
            request_id=rid, text="".join(text), token_ids=token_ids, finish_reason=_FINISH[last.finish_reason],
            usage=usage_to_pb(last.usage), adapter_id=last.adapter_id, adapter_digest=last.adapter_digest)

    async def GenerateStream(self, request, context):
        async with aclosing(self._outputs(request, context, "GenerateStream")) as outs:
            async for out in outs:
                msg = worker_pb2.GenerateStreamResponse(request_id=out.request_id, text=out.text,
                                                        token_ids=out.token_ids)
                if out.finish_reason is not None:
                    msg.finish_reason = _FINISH[out.finish_reason]
                    if out.usage is not None:
                        msg.usage.CopyFrom(usage_to_pb(out.usage))
                elif not out.text and not out.token_ids:
                    continue
                yield msg

    async def GetWorkerInfo(self, request, context):
        e, c = self.engine, self.config
        return worker_pb2.WorkerInfo(
            worker_id=c.resolved_worker_id, model=e.model.config.name, dtype=str(e.model.dtype).removeprefix("torch."),
            device=str(e.model.device), max_loras=c.max_loras if self.adapters is not None else 0,
            max_cpu_loras=c.max_cpu_loras if self.adapters is not None else 0,
            max_lora_rank=c.max_lora_rank if self.adapters is not None else 0,
            max_num_seqs=e.config.max_num_seqs, max_model_len=e.config.max_model_len,
            num_kv_blocks=e.config.num_blocks, block_size=e.config.block_size,
            vocab_size=e.model.config.vocab_size, version=VERSION, num_waiting=e.num_waiting,
            num_running=e.num_running)

    async def _admin(self, context, call):
        await self._authorize(context, self.config.admin_token)
        try:
            if self.adapters is None:
                raise NoAdapterStore()
            return await call(self.adapters)
        except WorkerError as exc:
            await context.abort(grpc_status_code(exc), str(exc))

    async def LoadAdapter(self, request, context):
        async def load(adapters):
            tiers = {worker_pb2.ADAPTER_TIER_UNSPECIFIED: "gpu", worker_pb2.ADAPTER_TIER_GPU: "gpu",
                     worker_pb2.ADAPTER_TIER_CPU: "cpu"}
            if request.tier not in tiers:
                raise InvalidRequest(f"tier must be ADAPTER_TIER_GPU or ADAPTER_TIER_CPU, got {request.tier}")
            return await adapters.load_adapter(request.adapter_id, tiers[request.tier])

        state = await self._admin(context, load)
        return worker_pb2.LoadAdapterResponse(adapter=adapter_to_pb(state))

    async def UnloadAdapter(self, request, context):
        unloaded = await self._admin(context, lambda a: a.unload_adapter(request.adapter_id))
        return worker_pb2.UnloadAdapterResponse(unloaded=bool(unloaded))

    async def PinAdapter(self, request, context):
        state = await self._admin(context, lambda a: a.pin_adapter(request.adapter_id, request.pinned))
        return worker_pb2.PinAdapterResponse(adapter=adapter_to_pb(state))

    async def ListAdapters(self, request, context):
        if self.adapters is None:
            return worker_pb2.ListWorkerAdaptersResponse()
        states = self.adapters.list_adapters()
        states = sorted(states, key=lambda s: (s.tier != "gpu", s.tier != "cpu", s.adapter_id))
        return worker_pb2.ListWorkerAdaptersResponse(adapters=[adapter_to_pb(s) for s in states])
