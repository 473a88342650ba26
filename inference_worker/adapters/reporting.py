"""Per-adapter counters and the `AdapterState` rows that ListAdapters and the admin RPCs report."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.inference_worker.adapters.slot_table import SlotState
from loraserve.inference_worker.engine.adapter_hooks import AdapterState
from loraserve.inference_worker.lora.payload import AdapterPayload


@dataclass
class AdapterStats:
    num_requests: int = 0
    num_tokens: int = 0
    num_gpu_loads: int = 0
    last_used: float = 0.0  # wall-clock seconds, 0 = never


def _state(
    adapter_id: str, digest: str, tier: str, st: AdapterStats, pinned: bool, **held: int
) -> AdapterState:
    return AdapterState(
        adapter_id=adapter_id,
        digest=digest,
        tier=tier,
        pinned=pinned,
        last_used=st.last_used or None,
        num_requests=st.num_requests,
        num_tokens=st.num_tokens,
        num_gpu_loads=st.num_gpu_loads,
        **held,
    )


def slot_state(s: SlotState, st: AdapterStats, pinned: bool) -> AdapterState:
    return _state(
        s.adapter_id,
        s.digest,
        "gpu",
        st,
        pinned,
        slot=s.index,
        rank=s.rank,
        size_bytes=s.size_bytes,
        num_running=s.running,
    )


def cpu_state(p: AdapterPayload, st: AdapterStats, pinned: bool) -> AdapterState:
    return _state(p.adapter_id, p.digest, "cpu", st, pinned, rank=p.rank, size_bytes=p.nbytes)


def other_state(adapter_id: str, digest: str, tier: str, st: AdapterStats, pinned: bool) -> AdapterState:
    """A version loading (tier "loading") or held nowhere (tier "")."""
    return _state(adapter_id, digest, tier, st, pinned)
