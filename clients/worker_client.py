"""Typed clients of InferenceWorker, sync (`WorkerClient`) and asyncio (`AsyncWorkerClient`).

    with WorkerClient("127.0.0.1:50052") as w:
        print(w.generate("Hello", max_tokens=20).text)
        for delta in w.generate_stream("Once upon a time", temperature=0.8, seed=1):
            print(delta.text, end="", flush=True)

Failures surface as `grpc.RpcError` with the server's status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from loraserve.v1 import worker_pb2, worker_pb2_grpc

from clients.channel import bearer_metadata, open_aio_channel, open_channel

FINISH_REASONS = {
    worker_pb2.FINISH_REASON_UNSPECIFIED: None,
    worker_pb2.FINISH_REASON_LENGTH: "length",
    worker_pb2.FINISH_REASON_STOP: "stop",
    worker_pb2.FINISH_REASON_EOS: "eos",
    worker_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
TIERS = {"gpu": worker_pb2.ADAPTER_TIER_GPU, "cpu": worker_pb2.ADAPTER_TIER_CPU}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    queue_time_ms: float
    time_to_first_token_ms: float
    total_time_ms: float

    @classmethod
    def from_pb(cls, u: worker_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.queue_time_ms, u.time_to_first_token_ms,
                   u.total_time_ms)


@dataclass(frozen=True)
class Generation:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    adapter_id: str = ""
    adapter_digest: str = ""


@dataclass(frozen=True)
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta only
    usage: Usage | None = None  # set on the last delta only


def build_request(prompt: str | Sequence[int], *, adapter_id: str = "", max_tokens: int = 0,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  request_id: str = "") -> worker_pb2.GenerateRequest:
    sampling = worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                         ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    req = worker_pb2.GenerateRequest(adapter_id=adapter_id, sampling=sampling, request_id=request_id)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(int(t) for t in prompt)
    return req


def _generation(r: worker_pb2.GenerateResponse) -> Generation:
    return Generation(r.request_id, r.text, list(r.token_ids), FINISH_REASONS[r.finish_reason],
                      Usage.from_pb(r.usage), r.adapter_id, r.adapter_digest)


def _delta(r: worker_pb2.GenerateStreamResponse) -> Delta:
    last = r.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
    return Delta(r.request_id, r.text, list(r.token_ids), FINISH_REASONS[r.finish_reason],
                 Usage.from_pb(r.usage) if last else None)


class _Base:
    def __init__(self, token: str | None, admin_token: str | None, timeout: float | None) -> None:
        self._token, self._admin_token, self.timeout = token, admin_token, timeout

    def _md(self, admin: bool = False) -> tuple[tuple[str, str], ...] | None:
        return bearer_metadata(self._admin_token if admin else self._token)


class WorkerClient(_Base):
    def __init__(self, address: str, *, token: str | None = None, admin_token: str | None = None,
                 tls_ca: str | None = None, timeout: float | None = None) -> None:
        super().__init__(token, admin_token, timeout)
        self.channel = open_channel(address, root_certificates=tls_ca)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **kw) -> Generation:
        r = self.stub.Generate(build_request(prompt, **kw), metadata=self._md(), timeout=timeout or self.timeout)
        return _generation(r)

    def generate_stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, **kw) -> Iterator[Delta]:
        call = self.stub.GenerateStream(build_request(prompt, **kw), metadata=self._md(),
                                        timeout=timeout or self.timeout)
        try:
            for r in call:
                yield _delta(r)
        finally:
            call.cancel()

    def info(self) -> worker_pb2.WorkerInfo:
        return self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self.timeout)

    def load_adapter(self, adapter_id: str, tier: str = "gpu") -> worker_pb2.WorkerAdapter:
        return self.stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id, tier=TIERS[tier]),
                                     metadata=self._md(admin=True), timeout=self.timeout).adapter

    def unload_adapter(self, adapter_id: str) -> bool:
        return self.stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id),
                                       metadata=self._md(admin=True), timeout=self.timeout).unloaded

    def pin_adapter(self, adapter_id: str, pinned: bool = True) -> worker_pb2.WorkerAdapter:
        return self.stub.PinAdapter(worker_pb2.PinAdapterRequest(adapter_id=adapter_id, pinned=pinned),
                                    metadata=self._md(admin=True), timeout=self.timeout).adapter

    def list_adapters(self) -> list[worker_pb2.WorkerAdapter]:
        return list(self.stub.ListAdapters(worker_pb2.ListWorkerAdaptersRequest(), timeout=self.timeout).adapters)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWorkerClient(_Base):
    def __init__(self, address: str, *, token: str | None = None, admin_token: str | None = None,
                 tls_ca: str | None = None, timeout: float | None = None) -> None:
        super().__init__(token, admin_token, timeout)
        self.channel = open_aio_channel(address, root_certificates=tls_ca)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, **kw) -> Generation:
        r = await self.stub.Generate(build_request(prompt, **kw), metadata=self._md(),
                                     timeout=timeout or self.timeout)
        return _generation(r)

    async def generate_stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                              **kw) -> AsyncIterator[Delta]:
        call = self.stub.GenerateStream(build_request(prompt, **kw), metadata=self._md(),
                                        timeout=timeout or self.timeout)
        try:
            async for r in call:
                yield _delta(r)
        finally:
            call.cancel()

    async def info(self) -> worker_pb2.WorkerInfo:
        return await self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self.timeout)

    async def load_adapter(self, adapter_id: str, tier: str = "gpu") -> worker_pb2.WorkerAdapter:
        r = await self.stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id=adapter_id, tier=TIERS[tier]),
                                        metadata=self._md(admin=True), timeout=self.timeout)
        return r.adapter

    async def unload_adapter(self, adapter_id: str) -> bool:
        r = await self.stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id),
                                          metadata=self._md(admin=True), timeout=self.timeout)
        return r.unloaded

    async def pin_adapter(self, adapter_id: str, pinned: bool = True) -> worker_pb2.WorkerAdapter:
        r = await self.stub.PinAdapter(worker_pb2.PinAdapterRequest(adapter_id=adapter_id, pinned=pinned),
                                       metadata=self._md(admin=True), timeout=self.timeout)
        return r.adapter

    async def list_adapters(self) -> list[worker_pb2.WorkerAdapter]:
        r = await self.stub.ListAdapters(worker_pb2.ListWorkerAdaptersRequest(), timeout=self.timeout)
        return list(r.adapters)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
