"""An adapter pool against a real store, driven by the test: its event loop on a thread (as the
worker's server provides it), the coordinator sync run round by round (no thread)."""

from __future__ import annotations

import asyncio
import json
import threading

import torch

from loraserve.inference_worker.adapters import AdapterPool, AdapterRef, WorkerAdapters
from loraserve.inference_worker.adapters.store_source import StoreSource
from loraserve.inference_worker.coordination import Coordinator, InProcessCoordinator
from loraserve.inference_worker.lora import LoRASlots


class Harness:
    """A pool with its event loop on a thread, like the worker's server provides, and a
    coordinator sync that the test runs round by round (no thread)."""

    def __init__(
        self,
        model_dir,
        store_address: str,
        max_loras: int = 3,
        max_cpu_loras: int = 4,
        max_cpu_bytes: int = 1 << 30,
        coordinator: Coordinator | None = None,
        worker_id: str = "worker",
        lookahead: int = 0,
        prefetch: int = 0,
        max_fetches: int = 4,
        fetch_process: bool = False,
    ) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.slots = LoRASlots(config, max_loras, 64, torch.float32, "cpu")
        self.source = StoreSource(
            store_address, timeout_s=10, max_retries=1, max_fetches=max_fetches, fetch_process=fetch_process
        )
        self.coordinator = coordinator if coordinator is not None else InProcessCoordinator()
        self.pool = AdapterPool(
            self.slots,
            self.source,
            self.coordinator,
            max_cpu_loras=max_cpu_loras,
            max_cpu_bytes=max_cpu_bytes,
            worker_id=worker_id,
        )
        self.adapters = WorkerAdapters(
            self.pool, self.coordinator, max_tokens=64, lookahead=lookahead, prefetch=prefetch
        )
        self.sync = self.adapters.sync
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool.fetcher.start(self.loop)

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def acquire(self, seq_key: int, ref: str):
        return self.pool.acquire(seq_key, AdapterRef.parse(ref))

    def ensure_cpu(self, ref: str):
        return self.pool.ensure_cpu(AdapterRef.parse(ref))

    def acquire_eventually(self, seq_key: int, ref: str, timeout: float = 20.0):
        """acquire() as the scheduler does it: retry each 'step' until admitted or failed."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.acquire(seq_key, ref)
            if got is not None:
                return got
            time.sleep(0.01)
        raise TimeoutError(ref)

    def close(self) -> None:
        import time

        self.loop.call_soon_threadsafe(self.pool.fetcher.close)
        self.run(self.source.close())
        end = time.monotonic() + 5.0
        while self.pool.fetcher.flights and time.monotonic() < end:  # fetches the close ended
            time.sleep(0.01)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
