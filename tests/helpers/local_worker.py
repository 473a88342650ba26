"""The worker's engine with LoRA, in-process and without gRPC, for tests that drive it directly."""

from __future__ import annotations

from pathlib import Path


class DelayedSource:
    """The store as an adapter source whose every fetch takes `delay_s` longer (a slow store)."""

    def __init__(self, source, delay_s: float) -> None:
        self.source, self.delay_s = source, delay_s

    async def fetch(self, adapter_id: str, digest: str = ""):
        import asyncio

        await asyncio.sleep(self.delay_s)
        return await self.source.fetch(adapter_id, digest)

    async def close(self) -> None:
        await self.source.close()


class LocalWorker:
    """The engine with LoRA, in-process: the step thread plus an asyncio loop thread for fetches
    (what the worker's server wires up, minus gRPC)."""

    def __init__(
        self,
        model_dir: Path,
        store_address: str,
        *,
        max_loras: int = 4,
        max_cpu_loras: int = 8,
        max_num_seqs: int = 16,
        poll_interval_s: float = 0.2,
        start_engine: bool = True,
        lookahead: int = 16,
        prefetch: int = 8,  # popularity prefetch per coordination round (the worker's default)
        fetch_delay_s: float = 0.0,
    ) -> None:
        import asyncio
        import threading

        from loraserve.inference_worker.builder import build_worker, store_source
        from loraserve.inference_worker.config import WorkerConfig

        config = WorkerConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=max_num_seqs,
            max_model_len=256,
            max_num_batched_tokens=256,
            num_kv_blocks=256,
            cuda_graphs=False,
            store_address=store_address,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=64,
            adapter_poll_interval_s=poll_interval_s,
            adapter_lookahead=lookahead,
            adapter_prefetch=prefetch,
        )
        source = DelayedSource(store_source(config), fetch_delay_s) if fetch_delay_s else None
        worker = build_worker(config, source=source)  # what the worker's server builds, minus gRPC
        assert worker.adapters is not None
        self.engine, self.adapters = worker.engine, worker.adapters
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.adapters.start(self.loop, on_fetched=self.engine.wake)
        if start_engine:  # else the test drives the engine's parts on its own thread
            self.engine.start()
        self._n = 0

    def call(self, coro, timeout: float = 60):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, prompt_ids: list[int], adapter_id: str = "", max_tokens: int = 8):
        """-> a concurrent future of (tokens, error, final output)."""
        import concurrent.futures

        from loraserve.inference_worker.engine.sequence import SamplingParams

        fut: concurrent.futures.Future = concurrent.futures.Future()
        tokens: list[int] = []

        def on_output(out) -> None:
            tokens.extend(out.token_ids)
            if out.finished:
                fut.set_result((tokens, out.error, out))

        self._n += 1
        seq = self.engine.make_sequence(
            f"r{self._n}", "", prompt_ids, SamplingParams(max_tokens=max_tokens), on_output, adapter_id
        )
        self.engine.submit(seq)
        return fut

    def generate(self, prompt_ids: list[int], adapter_id: str = "", max_tokens: int = 8, timeout: float = 60):
        return self.submit(prompt_ids, adapter_id, max_tokens).result(timeout)

    def close(self) -> None:
        self.engine.shutdown()
        self.call(self.adapters.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
