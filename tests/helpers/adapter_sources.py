"""The worker's adapters without a store: an adapter source serving payloads held in memory, and
an event loop thread to run the adapters' fetches and admin calls on (what the worker's server
provides), for GPU tests and benchmarks that load adapters through the worker's own admin path."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from typing import Any

from loraserve.inference_worker.adapters import WorkerAdapters
from loraserve.inference_worker.errors import AdapterNotFound
from loraserve.inference_worker.lora.payload import AdapterPayload


class PayloadSource:
    """An `AdapterSource` over payloads already in memory, by adapter id."""

    def __init__(self, payloads: Iterable[AdapterPayload]) -> None:
        self.payloads = {p.adapter_id: p for p in payloads}

    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload:
        p = self.payloads.get(adapter_id)
        if p is None or (digest and digest != p.digest):
            raise AdapterNotFound(f"adapter {adapter_id!r} is not among the payloads held")
        return p


class AdaptersRunning:
    """`adapters` started on an event loop of their own thread; `close()` stops both."""

    def __init__(self, adapters: WorkerAdapters) -> None:
        self.adapters = adapters
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        adapters.start(self.loop, on_fetched=lambda: None)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def load(self, adapter_ids: Iterable[str], tier: str = "gpu") -> None:
        for adapter_id in adapter_ids:
            self.call(self.adapters.load_adapter(adapter_id, tier))

    def close(self) -> None:
        self.call(self.adapters.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
