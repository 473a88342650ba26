"""The InferenceWorker servicer: pb -> engine request -> pb. Domain errors propagate; the server's
interceptors (loraserve/serving/interceptors.py) check bearer tokens and make errors statuses."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

from google.protobuf.timestamp_pb2 import Timestamp

from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.adapter_hooks import AdapterAdmin, AdapterState
from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams
from loraserve.inference_worker.errors import Draining, InvalidRequest, NoAdapterStore, WorkerError
from loraserve.inference_worker.metrics import WorkerMetrics
from loraserve.inference_worker.model.chat_template import ChatMessage
from loraserve.inference_worker.model.token_bytes import TokenBytes
from loraserve.inference_worker.output_delivery import split
from loraserve.inference_worker.output_reader import OutputReader
from loraserve.inference_worker.outputs_pb import ResponseBuilder, stream_delta, stream_message
from loraserve.inference_worker.relay.front_text import text_from_tokens
from loraserve.inference_worker.request_observer import RequestObserver
from loraserve.serving.errors import status_of
from loraserve.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from grpc.aio import ServicerContext

    from loraserve.inference_worker.relay.core import RelayStream


VERSION = "0.1.0"
# a request of prompt token ids only, up to this many, is built on the event loop (its checks are
# a pass over the ids); text to tokenize or messages to render, or more ids, go to a thread
INLINE_PROMPT_IDS = 8192

_TIERS = {
    "gpu": worker_pb2.ADAPTER_TIER_GPU,
    "cpu": worker_pb2.ADAPTER_TIER_CPU,
    "loading": worker_pb2.ADAPTER_TIER_LOADING,
}


def sampling_from_pb(
    s: worker_pb2.SamplingParams, detokenize: bool = True, stream_interval: int = 0
) -> SamplingParams:
    """`detokenize` False is kept only for requests whose text needs nothing but their tokens;
    `stream_interval` is the request's (GenerateRequest.stream_interval, 0 = the worker's)."""
    return SamplingParams(
        max_tokens=s.max_tokens,
        fill_context=s.fill_context,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.top_p != 0 else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        n=s.n if s.n != 0 else 1,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 0 else 1.0,
        stream_interval=stream_interval,
        detokenize=detokenize or not text_from_tokens(s),
    )


def adapter_to_pb(a: AdapterState) -> worker_pb2.WorkerAdapter:
    pb = worker_pb2.WorkerAdapter(
        adapter_id=a.adapter_id,
        digest=a.digest,
        tier=_TIERS.get(a.tier, worker_pb2.ADAPTER_TIER_UNSPECIFIED),
        slot=a.slot,
        pinned=a.pinned,
        rank=a.rank,
        size_bytes=a.size_bytes,
        num_requests=a.num_requests,
        num_tokens=a.num_tokens,
        num_gpu_loads=a.num_gpu_loads,
        num_running=a.num_running,
    )
    if a.last_used is not None:
        ts = Timestamp()
        ts.FromNanoseconds(int(a.last_used * 1e9))
        pb.last_used.CopyFrom(ts)
    return pb


class InferenceWorkerServicer(worker_pb2_grpc.InferenceWorkerServicer):
    def __init__(
        self,
        engine: LLMEngine,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        adapters: AdapterAdmin | None = None,
    ) -> None:
        self.engine, self.config, self.metrics, self.adapters = engine, config, metrics, adapters
        self.draining = False
        self.failure: WorkerError | None = None  # set when the worker can no longer compute
        self.token_text = TokenBytes(engine.tokenizer)  # token id -> (text, bytes) for logprobs
        self._calls: set[asyncio.Queue[RequestOutput]] = set()  # the output queues of generations in flight

    @property
    def active(self) -> int:
        """Generations in flight."""
        return len(self._calls)

    def fail(self, error: WorkerError) -> int:
        """End every generation in flight with `error` and refuse new ones with it, without waiting
        for the engine (whose step may be stuck); -> how many were ended. On the event loop."""
        self.failure = error
        for queue in self._calls:
            queue.put_nowait(RequestOutput("", [], "", error=error))
        return len(self._calls)

    # -------------------------------------------------------------------------- helpers
    async def _outputs(
        self,
        request: worker_pb2.GenerateRequest,
        context: ServicerContext,
        method: str,
        direct: Callable[[RequestOutput], None] | None = None,
        detokenize: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submits the request and yields its outputs; aborting the sequence if the call goes away.
        With `direct`, the running outputs go to it on arrival (on the event loop) and only the
        last one is yielded. `detokenize` False: outputs carry tokens only, where the request
        allows it (no stop strings, no logprobs): the relay's front makes their text."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        on_output = queue.put_nowait if direct is None else split(direct, queue.put_nowait)
        rid = request.request_id or uuid.uuid4().hex
        observer = RequestObserver(rid, request.adapter_id, self.metrics.per_adapter)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        finished = False
        try:
            if self.failure is not None:  # a copy: raising the shared error would grow its traceback
                raise copy.copy(self.failure)
            if self.draining:
                raise Draining("the worker is draining; retry on another worker")
            args = (
                rid,
                request.prompt,
                list(request.prompt_token_ids),
                sampling_from_pb(request.sampling, detokenize, request.stream_interval),
                on_output,
                request.adapter_id,
                deadline,
                [ChatMessage(m.role, m.content) for m in request.messages],
                request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
            )
            if request.prompt or request.messages or len(request.prompt_token_ids) > INLINE_PROMPT_IDS:
                # tokenizing, rendering a chat template, scanning a long prompt: off the event loop
                seq = await asyncio.to_thread(self.engine.make_sequence, *args)
            else:  # token ids only: a few checks, cheaper here than a hand-off to a thread and back
                seq = self.engine.make_sequence(*args)
            if self.failure is not None:  # failed while the request was being built
                raise copy.copy(self.failure)
            observer.submitted(seq)
            self.engine.submit(seq)
        except WorkerError as exc:
            self.metrics.count_request(method, exc.code, request.adapter_id)
            raise
        self._calls.add(queue)
        reader = OutputReader(queue)
        try:
            while True:
                out = await reader.next()
                if out.last:  # all n completions ended, or one failed
                    finished = True
                    if out.error is not None:
                        self.engine.abort(rid)  # the other completions, if any
                        self.metrics.count_request(method, status_of(out.error)[0], request.adapter_id)
                        # a copy: the sequence and the output keep the error, and this frame them;
                        # raised itself, its traceback would hold this frame, a reference cycle
                        # that keeps the whole request for the garbage collector
                        raise copy.copy(out.error) if isinstance(out.error, WorkerError) else out.error
                    self.metrics.count_request(method, "OK", request.adapter_id)
                    if out.usage is not None:
                        self.metrics.observe_finished(out.usage, request.adapter_id)
                        observer.finished(out.usage, out.adapter_digest)
                yield out
                if finished:
                    return
        finally:
            self._calls.discard(queue)
            if not finished:
                self.engine.abort(rid)
                self.metrics.count_request(method, "CANCELLED", request.adapter_id)

    # ---------------------------------------------------------------------------- RPCs
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: ServicerContext
    ) -> worker_pb2.GenerateResponse:
        response = ResponseBuilder(request.request_id, self.token_text)
        async with aclosing(self._outputs(request, context, "Generate")) as outs:
            async for out in outs:
                response.add(out)
        return response.response()

    async def GenerateStream(
        self, request: worker_pb2.GenerateRequest, context: ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        # a relayed call (relay/core.py) takes its running messages straight from the engine's
        # hand-over, not through this generator and the interceptors' around it: no task switch
        # and no generator round trip per token on the event loop
        relay: RelayStream | None = getattr(context, "relay_stream", None)
        direct = None
        if relay is not None:
            token_text = self.token_text

            def direct(out: RequestOutput) -> None:
                if out.logprobs:  # tokens' texts and bytes come from this worker's tokenizer
                    if (msg := stream_message(out, token_text)) is not None:
                        relay.message(msg)
                elif (delta := stream_delta(out)) is not None:
                    relay.delta(delta)

        detokenize = relay is None or not relay.text_in_front
        outputs = self._outputs(request, context, "GenerateStream", direct, detokenize)
        async with aclosing(outputs) as outs:
            async for out in outs:
                msg = stream_message(out, self.token_text)
                if msg is not None:
                    yield msg

    async def GetWorkerInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: ServicerContext
    ) -> worker_pb2.WorkerInfo:
        e, c = self.engine, self.config
        return worker_pb2.WorkerInfo(
            worker_id=c.resolved_worker_id,
            model=e.model.config.name,
            dtype=str(e.model.dtype).removeprefix("torch."),
            device=str(e.model.device),
            max_loras=c.max_loras if self.adapters is not None else 0,
            max_cpu_loras=c.max_cpu_loras if self.adapters is not None else 0,
            max_lora_rank=c.max_lora_rank if self.adapters is not None else 0,
            max_num_seqs=e.config.max_num_seqs,
            max_model_len=e.config.max_model_len,
            num_kv_blocks=e.config.num_blocks,
            block_size=e.config.block_size,
            vocab_size=e.model.config.vocab_size,
            version=VERSION,
            num_waiting=e.num_waiting,
            num_running=e.num_running,
        )

    def _adapters(self) -> AdapterAdmin:
        if self.adapters is None:
            raise NoAdapterStore()
        return self.adapters

    async def LoadAdapter(
        self, request: worker_pb2.LoadAdapterRequest, context: ServicerContext
    ) -> worker_pb2.LoadAdapterResponse:
        adapters = self._adapters()
        tiers = {
            worker_pb2.ADAPTER_TIER_UNSPECIFIED: "gpu",
            worker_pb2.ADAPTER_TIER_GPU: "gpu",
            worker_pb2.ADAPTER_TIER_CPU: "cpu",
        }
        if request.tier not in tiers:
            raise InvalidRequest(f"tier must be ADAPTER_TIER_GPU or ADAPTER_TIER_CPU, got {request.tier}")
        state = await adapters.load_adapter(request.adapter_id, tiers[request.tier])
        return worker_pb2.LoadAdapterResponse(adapter=adapter_to_pb(state))

    async def UnloadAdapter(
        self, request: worker_pb2.UnloadAdapterRequest, context: ServicerContext
    ) -> worker_pb2.UnloadAdapterResponse:
        unloaded = await self._adapters().unload_adapter(request.adapter_id)
        return worker_pb2.UnloadAdapterResponse(unloaded=bool(unloaded))

    async def PinAdapter(
        self, request: worker_pb2.PinAdapterRequest, context: ServicerContext
    ) -> worker_pb2.PinAdapterResponse:
        state = await self._adapters().pin_adapter(request.adapter_id, request.pinned)
        return worker_pb2.PinAdapterResponse(adapter=adapter_to_pb(state))

    async def ListAdapters(
        self, request: worker_pb2.ListWorkerAdaptersRequest, context: ServicerContext
    ) -> worker_pb2.ListWorkerAdaptersResponse:
        if self.adapters is None:
            return worker_pb2.ListWorkerAdaptersResponse()
        states = self.adapters.list_adapters()
        states = sorted(states, key=lambda s: (s.tier != "gpu", s.tier != "cpu", s.adapter_id))
        return worker_pb2.ListWorkerAdaptersResponse(adapters=[adapter_to_pb(s) for s in states])
