"""`WorkerAdapters`: the worker's adapters as the engine and the service see them — the engine's
seam (`EngineAdapters`: admission and the per-step LoRA batch) and the admin RPCs (`AdapterAdmin`)
over one `AdapterPool`, plus the background work that keeps it in step with the cluster.

Admission (vLLM's max_loras rule): a sequence is admitted only when its adapter is in a GPU slot,
or a slot can be filled this step from the CPU tier without evicting an adapter that a running
sequence uses. Otherwise `can_admit` answers False at once — a miss in both tiers starts one fetch
on the event loop — and the scheduler keeps scanning the queue, so base requests and requests for
resident adapters never wait behind a cold one. Nothing here waits on the network on the step
thread: the coordinator is reached only from `CoordinatorSync`'s thread (and, before that thread
starts, by preload.py at start-up).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import torch
from prometheus_client import CollectorRegistry

from loraserve.inference_worker.adapters.coordinator_sync import CoordinatorSync
from loraserve.inference_worker.adapters.pool import AdapterPool
from loraserve.inference_worker.adapters.popularity import FleetMemory
from loraserve.inference_worker.adapters.refs import AdapterRef
from loraserve.inference_worker.adapters.staging import AheadOfNeed
from loraserve.inference_worker.adapters.store_check import StoreCheck
from loraserve.inference_worker.adapters.usage_metrics import AdapterUsageMetrics
from loraserve.inference_worker.coordination import Coordinator, InvalidationEvent
from loraserve.inference_worker.engine.adapter_hooks import AdapterState
from loraserve.inference_worker.engine.sequence import Sequence
from loraserve.inference_worker.errors import WorkerError, detached
from loraserve.inference_worker.lora.layer import LoRALayer
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.kernels import LaunchOptions, LoRABatch
from loraserve.serving import tracing

POPULARITY_TOP = 256  # adapters of this worker's counts published each round


class WorkerAdapters:
    def __init__(
        self,
        pool: AdapterPool,
        coordinator: Coordinator,
        *,
        max_tokens: int,
        list_digests: Callable[[], Awaitable[dict[str, str]]] | None = None,
        interval_s: float = 2.0,
        lookahead: int = 0,
        prefetch: int = 0,
        max_fetches: int = 4,
        address: str = "",
    ) -> None:
        self.pool, self.coordinator = pool, coordinator
        self.list_digests = list_digests  # the store's adapters (id -> digest), where there is a store
        self.ahead = AheadOfNeed(pool, window=lookahead, max_fetches=max_fetches, max_prefetch=prefetch)
        self._requests_by_tier = {t: pool.metrics.requests.labels(t) for t in ("gpu", "cpu", "store")}
        slots = pool.slots
        # static buffers, prepared by sync-free ops: decode CUDA graphs capture the LoRA path
        self._lora_batch = LoRABatch.allocate(
            max_tokens, slots.max_loras, slots.device, max_slices=3, max_rank=slots.max_rank
        )
        self.sync = CoordinatorSync(
            coordinator,
            apply=self._apply_invalidation,
            flush_residency=pool.publisher.flush,
            heartbeat_info=self._load_info,
            worker_id=pool.worker_id,
            address=address,
            interval_s=interval_s,
            popularity=lambda: pool.popularity.top(POPULARITY_TOP),
            on_fleet_popularity=self.ahead.prefetch if prefetch else None,
            fleet_memory=FleetMemory(pool.popularity.half_life_s) if prefetch else None,
            on_state_lost=self._state_lost,
        )
        self.store_check = (
            StoreCheck(list_digests, pool.known_digests, self.sync.publish_invalidation, interval_s)
            if list_digests is not None
            else None
        )

    def attach_to(self, model: LlamaModel, options: LaunchOptions) -> None:
        """A LoRALayer on every grouped projection of `model`, launching with `options`."""
        slots: LoRASlots = self.pool.slots
        linears = model.grouped_linears()
        expected = slots.num_layers * len(slots.out_sizes)
        if len(linears) != expected:
            raise ValueError(f"the model has {len(linears)} grouped projections, the slots expect {expected}")
        for (layer, group), module in linears.items():
            module.lora = LoRALayer(slots, layer, group, options)

    # ------------------------------------------------------------------ lifecycle
    def start(
        self, loop: asyncio.AbstractEventLoop, on_fetched: Callable[[], None], *, sync: bool = True
    ) -> None:
        """Fetches and the store check run on `loop`; `on_fetched` wakes the engine when a fetch ends.
        The source's fetch process (if it has one) starts now rather than at the first fetch.
        `sync` False: the fleet sync (heartbeat, residency, prefetch) waits for `start_sync`."""
        self.pool.fetcher.start(loop, on_fetched)
        start_source = getattr(self.pool.fetcher.source, "start", None)
        if start_source is not None:
            start_source()
        if sync:
            self.start_sync()
        if self.store_check is not None:
            self.store_check.start(loop)

    def start_sync(self) -> None:
        """The fleet sync thread: the worker is announced (routers send it requests) from now."""
        self.sync.start()

    async def close(self) -> None:
        if self.store_check is not None:
            await self.store_check.stop()
        await asyncio.to_thread(self.sync.stop)
        self.pool.fetcher.close()
        close = getattr(self.pool.fetcher.source, "close", None)
        if close is not None:
            await close()

    def register_metrics(
        self, registry: CollectorRegistry, per_adapter: AdapterUsageMetrics | None = None
    ) -> None:
        self.pool.metrics.register_on(registry)
        if per_adapter is not None:  # loads by adapter, and residency read from the tiers at scrape
            self.pool.metrics.per_adapter = per_adapter
            per_adapter.residents = lambda: [(a.adapter_id, a.tier) for a in self.pool.list()]

    def _state_lost(self) -> None:
        """The coordinator lost its state, and with it invalidations not read yet: what this worker
        holds is compared with the store's registry now (nothing to compare with without a store)."""
        if self.store_check is not None:
            self.store_check.check_soon()

    def _apply_invalidation(self, event: InvalidationEvent) -> None:
        self.pool.apply_invalidation(event.adapter_id, event.digest)

    def _load_info(self) -> dict[str, float | int | str]:
        with self.pool.lock:
            tiers = self.pool.tiers
            return {
                "max_loras": self.pool.slots.max_loras,
                "slots_used": tiers.table.num_used,
                "cpu_cached": len(tiers.cpu),
            }

    # ------------------------------------------------------------------ engine seam (EngineAdapters)
    def validate(self, seq: Sequence) -> None:
        """At submission: a well-formed reference; counts the request for popularity and notes
        where the adapter is now (the tier the response reports)."""
        if seq.adapter_id:
            ref = AdapterRef.parse(seq.adapter_id)
            seq.adapter_tier = self.pool.arrival_tier(ref)
            self._requests_by_tier[seq.adapter_tier].inc()
            self.pool.popularity.record(ref.adapter_id)

    def look_ahead(self, waiting: Iterable[Sequence]) -> None:
        # a sequence refused at admission this step waits only to be failed: nothing to fetch
        if self.ahead.window:
            self.ahead.look_ahead((s.seq_id, s.adapter_id) for s in waiting if s.error is None)

    def can_admit(self, seq: Sequence) -> bool:
        if not seq.adapter_id:
            seq.lora_slot, seq.adapter_digest = -1, ""
            return True
        try:
            ref = AdapterRef.parse(seq.adapter_id)
            with tracing.attached(seq.trace_context):  # a load started here joins the request's trace
                got = self.pool.acquire(seq.seq_id, ref, new_request=seq.num_preemptions == 0)
        except WorkerError as exc:
            # kept until the sequence is failed, handed to the event loop: without the step's frames
            seq.error = detached(exc)
            return False
        if got is None:
            return False
        seq.lora_slot, seq.adapter_digest = got
        return True

    def on_finished(self, seq: Sequence) -> None:
        if seq.adapter_id:
            self.pool.release(seq.seq_id, len(seq.output_token_ids) if seq.finished else 0)

    def lora_batch(self, token_slots: torch.Tensor) -> LoRABatch:
        # token_slots: [T] int32 on the device, -1 = base row
        self._lora_batch.prepare(token_slots)
        return self._lora_batch

    # ------------------------------------------------------------------ admin (AdapterAdmin, event loop)
    async def load_adapter(self, adapter_id: str, tier: str) -> AdapterState:
        key = await self.pool.ensure_cpu(AdapterRef.parse(adapter_id))
        if tier == "gpu":
            await asyncio.to_thread(self.pool.activate_now, key)
        return self.pool.state(key)

    async def unload_adapter(self, adapter_id: str) -> bool:
        return self.pool.unload(AdapterRef.parse(adapter_id).adapter_id)

    async def pin_adapter(self, adapter_id: str, pinned: bool) -> AdapterState:
        ref = AdapterRef.parse(adapter_id)
        if not pinned:
            self.pool.set_pin(ref.adapter_id, None)
            return self.pool.state_of(AdapterRef(ref.adapter_id))
        with self.pool.lock:
            self.pool.check_pin_room(ref.adapter_id)
        key = await self.pool.ensure_cpu(ref)
        await asyncio.to_thread(self.pool.set_pin, ref.adapter_id, key)
        return self.pool.state(key)

    def list_adapters(self) -> list[AdapterState]:
        return self.pool.list()
