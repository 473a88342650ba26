"""The seams through which adapters plug into the engine and the service.

An `AdapterManager` (built by the LoRA code) is optional. Without one the engine uses
`BaseOnlyPolicy`: every request is admitted, a non-empty `adapter_id` is refused with
`NoAdapterStore` (FAILED_PRECONDITION), and the admin RPCs answer FAILED_PRECONDITION.

Engine side (all called on the engine thread, never on the asyncio loop):
- `validate(seq)` at submission (caller's thread): may raise a WorkerError (bad id, ...).
- `can_admit(seq) -> bool` for each waiting sequence the scheduler considers, only after its KV
  blocks are known to fit; non-blocking: it may start an async load and return False (the scheduler
  keeps scanning the queue past it). On True it sets `seq.lora_slot` (-1 = base) and
  `seq.adapter_digest`. To fail a sequence for good (load failed) set `seq.error` and return False.
- `on_admitted(seq)` when the sequence joins the running set; `on_finished(seq)` whenever it
  leaves it (finished, cancelled, or preempted back to the queue: `seq.finished` tells which).
- `build_lora_context(batch) -> object | None` once per step, after the runner filled
  `batch.token_slots` [T] int32 and `batch.seq_slots`; the result becomes `batch.lora` and reaches
  every `GroupedLinear.lora.apply(x, y, batch.lora)`. Return None when the step has no adapter
  rows. Steps with `batch.lora` set run eagerly (outside CUDA graphs) unless
  `supports_cuda_graphs` is True, in which case the object must live in static buffers.

Service side (async, on the event loop): `load_adapter`, `unload_adapter`, `pin_adapter`,
`list_adapters`, returning `AdapterState`; errors are WorkerErrors from inference_worker.errors.
`attach(engine, loop)` is called once when the server starts (the engine exposes `model` with
`grouped_linears()` -> {(layer, group): GroupedLinear}); `register_metrics(registry)` when the
server adopts the manager, `close()` when it stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from inference_worker.errors import NoAdapterStore

if TYPE_CHECKING:
    from inference_worker.engine.sequence import Sequence
    from inference_worker.model.forward_batch import ForwardBatch


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

    def on_admitted(self, seq: Sequence) -> None: ...

    def on_finished(self, seq: Sequence) -> None: ...


@runtime_checkable
class AdapterManager(AdmissionPolicy, Protocol):
    supports_cuda_graphs: bool

    def build_lora_context(self, batch: ForwardBatch) -> object | None: ...

    def attach(self, engine: object, loop: object) -> None: ...

    async def load_adapter(self, adapter_id: str, tier: str) -> AdapterState: ...

    async def unload_adapter(self, adapter_id: str) -> bool: ...

    async def pin_adapter(self, adapter_id: str, pinned: bool) -> AdapterState: ...

    def list_adapters(self) -> list[AdapterState]: ...

    async def close(self) -> None: ...

    def register_metrics(self, registry: object) -> None: ...


class BaseOnlyPolicy:
    """No adapters: admits everything, refuses adapter ids."""

    def validate(self, seq: Sequence) -> None:
        if seq.adapter_id:
            raise NoAdapterStore()

    def can_admit(self, seq: Sequence) -> bool:
        return True

    def on_admitted(self, seq: Sequence) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass
