"""The OpenAI-compatible endpoint as a benchmark target: `POST /v1/completions` with
`"stream": true`, read as server-sent events (`data: {json}` lines, ended by `data: [DONE]`), with
`stream_options.include_usage` so the last chunk carries the token counts. The model is the
adapter id, or `base_model` for base-model requests. Needs httpx (the `bench` extra)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from loraserve.clients.bench.targets import Chunk, Sampling, TargetError
from loraserve.clients.bench.workload import BenchRequest


def completions_url(base_url: str) -> str:
    """`http://h:8000`, `http://h:8000/` and `http://h:8000/v1` all mean `http://h:8000/v1/completions`."""
    base = base_url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", "")) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class OpenAITarget:
    def __init__(
        self, base_url: str, sampling: Sampling, *, base_model: str = "", api_key: str | None = None
    ) -> None:
        try:
            import httpx
        except ImportError as exc:  # the thin client install has no HTTP client
            raise RuntimeError("the OpenAI target needs httpx: pip install 'loraserve[bench]'") from exc
        self.url = completions_url(base_url)
        self.models_url = self.url.rsplit("/", 1)[0] + "/models"
        self.sampling, self.base_model = sampling, base_model
        self.description = f"OpenAI endpoint {self.url}"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # one connection per in-flight stream: no pool limit, the run's concurrency is the limit
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(sampling.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._httpx = httpx

    async def start(self) -> None:
        """Check the endpoint answers; without a base model name, take the first model it lists
        whose id is no adapter's (the gateway lists the base model first)."""
        try:
            r = await self.http.get(self.models_url)
        except self._httpx.HTTPError as exc:
            raise TargetError("connection error", f"{self.models_url}: {exc}") from None
        if r.status_code != 200:
            raise TargetError(f"HTTP {r.status_code}", _error_message(r.content))
        if not self.base_model:
            models = r.json().get("data") or []
            if models:
                self.base_model = str(models[0]["id"])

    async def vocab_size(self) -> int | None:
        return None

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.adapter_id or self.base_model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": self.sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, honoured by loraserve's gateway
        return body

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        try:
            async with self.http.stream("POST", self.url, json=self._body(request)) as r:
                if r.status_code != 200:
                    raise TargetError(f"HTTP {r.status_code}", _error_message(await r.aread()))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise TargetError("stream error", _error_message(data.encode()))
                    text = "".join(c.get("text") or "" for c in event.get("choices") or ())
                    usage = event.get("usage")
                    if usage:
                        yield Chunk(0, usage.get("prompt_tokens"), usage.get("completion_tokens"))
                    elif text:
                        # one chunk per token batch: counted as one token when no usage follows
                        yield Chunk(1)
        except self._httpx.TimeoutException as exc:
            raise TargetError("timeout", str(exc)) from None
        except self._httpx.HTTPError as exc:
            raise TargetError("connection error", str(exc)) from None

    async def close(self) -> None:
        await self.http.aclose()
