"""The engine's adapter seam (engine/adapter_hooks.py AdapterManager) backed by the LoRA slots and
the adapter manager: admission, the per-step LoRA batch, and the admin operations of the service.

Admission (vLLM's max_loras rule): a sequence is admitted only when its adapter is in a GPU slot,
or a slot can be filled this step from the CPU tier without evicting an adapter that a running
sequence uses. Otherwise `can_admit` answers False at once — a miss in both tiers starts one fetch
on the event loop — and the scheduler keeps scanning the queue, so base requests and requests for
resident adapters never wait behind a cold one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from inference_worker.adapters.manager import AdapterManager, AdapterSource, parse_ref
from inference_worker.adapters.metrics import AdapterMetrics
from inference_worker.adapters.watcher import Watcher
from inference_worker.coordination import Coordinator
from inference_worker.engine.adapter_hooks import AdapterState
from inference_worker.engine.sequence import Sequence
from inference_worker.errors import WorkerError
from inference_worker.lora.layer import LoRALayer
from inference_worker.lora.slots import LoRASlots
from inference_worker.model.forward_batch import ForwardBatch
from kernels import LoRABatch


class WorkerAdapters:
    # The LoRA batch lives in static buffers and its prepare() is sync-free: decode steps with
    # adapter rows can replay CUDA graphs captured with the LoRA path in them.
    supports_cuda_graphs = True

    def __init__(self, slots: LoRASlots, manager: AdapterManager, *, max_tokens: int,
                 list_digests: Callable | None = None, poll_interval_s: float = 2.0, address: str = "") -> None:
        self.slots, self.manager = slots, manager
        self.lora_batch = LoRABatch.allocate(max_tokens, slots.max_loras, slots.device, max_slices=3,
                                             max_rank=slots.max_rank)
        self.watcher = Watcher(manager, list_digests=list_digests, interval_s=poll_interval_s, address=address)
        self._attached = False

    @classmethod
    def create(cls, hf_config: dict, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
               max_cpu_bytes: int, dtype: torch.dtype, device: torch.device | str, max_tokens: int,
               source: AdapterSource | None, coordinator: Coordinator | None = None, worker_id: str = "worker",
               metrics: AdapterMetrics | None = None, poll_interval_s: float = 2.0,
               address: str = "") -> WorkerAdapters:
        slots = LoRASlots(hf_config, max_loras, max_lora_rank, dtype, device)
        manager = AdapterManager(slots, source, max_cpu_loras=max_cpu_loras, max_cpu_bytes=max_cpu_bytes,
                                 coordinator=coordinator, worker_id=worker_id, metrics=metrics)
        list_digests = getattr(source, "digests", None)
        return cls(slots, manager, max_tokens=max_tokens, list_digests=list_digests,
                   poll_interval_s=poll_interval_s, address=address)

    # ------------------------------------------------------------------ wiring
    def attach_model(self, model: object) -> int:
        """Attach a LoRALayer to every grouped projection ({(layer, group): GroupedLinear})."""
        linears = model.grouped_linears()  # type: ignore[attr-defined]
        for (layer, group), module in linears.items():
            module.lora = LoRALayer(self.slots, layer, group)
        expected = self.slots.num_layers * len(self.slots.out_sizes)
        if len(linears) != expected:
            raise ValueError(f"the model has {len(linears)} grouped projections, the slots expect {expected}")
        self._attached = True
        return len(linears)

    def register_metrics(self, registry) -> None:
        """Expose the adapter metrics on the worker's Prometheus registry too."""
        self.manager.metrics.register_on(registry)

    def attach(self, engine: object, loop: object) -> None:
        if not self._attached:
            self.attach_model(engine.model)  # type: ignore[attr-defined]
        assert isinstance(loop, asyncio.AbstractEventLoop)
        self.manager.bind_loop(loop)
        wake = getattr(engine, "wake", None)
        if callable(wake):
            self.manager.add_listener(wake)
        loop.call_soon_threadsafe(self.watcher.start)

    async def close(self) -> None:
        await self.watcher.stop()
        source = self.manager.source
        close = getattr(source, "close", None)
        if close is not None:
            await close()

    # ------------------------------------------------------------------ admission (engine thread)
    def validate(self, seq: Sequence) -> None:
        if seq.adapter_id:
            parse_ref(seq.adapter_id)

    def can_admit(self, seq: Sequence) -> bool:
        if not seq.adapter_id:
            seq.lora_slot, seq.adapter_digest = -1, ""
            return True
        try:
            got = self.manager.acquire(seq.seq_id, seq.adapter_id, new_request=seq.num_preemptions == 0)
        except WorkerError as exc:
            seq.error = exc
            return False
        if got is None:
            return False
        seq.lora_slot, seq.adapter_digest = got
        return True

    def on_admitted(self, seq: Sequence) -> None:
        pass  # the slot is held from can_admit on, so a later admission this step cannot evict it

    def on_finished(self, seq: Sequence) -> None:
        if seq.adapter_id:
            self.manager.release(seq.seq_id, len(seq.output_token_ids) if seq.finished else 0)

    def build_lora_context(self, batch: ForwardBatch) -> object | None:
        # token_slots: [T] int32 on the device, -1 = base row
        self.lora_batch.prepare(batch.token_slots)
        return self.lora_batch

    # ------------------------------------------------------------------ admin (event loop)
    async def load_adapter(self, adapter_id: str, tier: str) -> AdapterState:
        return await self.manager.load(adapter_id, tier)

    async def unload_adapter(self, adapter_id: str) -> bool:
        return await self.manager.unload(adapter_id)

    async def pin_adapter(self, adapter_id: str, pinned: bool) -> AdapterState:
        return await self.manager.pin(adapter_id, pinned)

    def list_adapters(self) -> list[AdapterState]:
        self.manager.poll_invalidations()
        return self.manager.list()
