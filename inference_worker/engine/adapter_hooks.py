"""The engine's seam to the adapters, and the service's.

`EngineAdapters` is what the engine asks of the adapters (adapters/worker_adapters.py
`WorkerAdapters` implements it); without adapters the engine admits with `BaseOnlyPolicy`: every
request is admitted, a non-empty `adapter_id` is refused with `NoAdapterStore`
(FAILED_PRECONDITION). `AdapterAdmin` is what the servicer's admin RPCs call.

Engine side (all on the engine's step thread, except `validate`, which runs on the caller's):
- `validate(seq)` at submission: may raise a WorkerError (a malformed adapter reference, ...).
- `can_admit(seq) -> bool` for each waiting sequence the scheduler considers, once its KV blocks
  are known to fit; never blocks: it may start an async load and answer False (the scheduler keeps
  scanning past it). On True it has set `seq.lora_slot` (-1 = base) and `seq.adapter_digest`, and
  the sequence holds that slot until `on_finished`. To fail a sequence for good it sets
  `seq.error` and answers False.
- `look_ahead(waiting)` once per step, after admission, with the waiting queue in arrival order:
  may start bringing queued requests' adapters in (never blocks).
- `on_finished(seq)` whenever a sequence leaves the running set (finished, cancelled, or
  preempted back to the queue: `seq.finished` tells which).
- `lora_batch(token_slots) -> LoRABatch` per step with adapter rows: the batch metadata every
  LoRA layer reads, prepared in static buffers with sync-free ops, so it is also called inside the
  decode CUDA graphs the runner captures.

Service side (async, on the event loop): `load_adapter`, `unload_adapter`, `pin_adapter`,
`list_adapters`, returning `AdapterState`; errors are WorkerErrors from inference_worker.errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loraserve.inference_worker.errors import NoAdapterStore

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from loraserve.inference_worker.engine.sequence import Sequence
    from loraserve.kernels import LoRABatch


@dataclass
class AdapterState:
    adapter_id: str
    digest: str = ""
    tier: str = ""  # "gpu", "cpu", "loading" or "" (not held)
    slot: int = -1
    pinned: bool = False
    last_used: float | None = None  # unix seconds
    rank: int = 0
    size_bytes: int = 0
    num_requests: int = 0
    num_tokens: int = 0
    num_gpu_loads: int = 0
    num_running: int = 0


class AdmissionPolicy(Protocol):
    def validate(self, seq: Sequence) -> None: ...

    def can_admit(self, seq: Sequence) -> bool: ...

    def look_ahead(self, waiting: Iterable[Sequence]) -> None: ...

    def on_finished(self, seq: Sequence) -> None: ...


class EngineAdapters(AdmissionPolicy, Protocol):
    def lora_batch(self, token_slots: torch.Tensor) -> LoRABatch: ...


class AdapterAdmin(Protocol):
    async def load_adapter(self, adapter_id: str, tier: str) -> AdapterState: ...

    async def unload_adapter(self, adapter_id: str) -> bool: ...

    async def pin_adapter(self, adapter_id: str, pinned: bool) -> AdapterState: ...

    def list_adapters(self) -> list[AdapterState]: ...


class BaseOnlyPolicy:
    """No adapters: admits everything, refuses adapter ids."""

    def validate(self, seq: Sequence) -> None:
        if seq.adapter_id:
            raise NoAdapterStore()

    def can_admit(self, seq: Sequence) -> bool:
        return True

    def look_ahead(self, waiting: Iterable[Sequence]) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass
