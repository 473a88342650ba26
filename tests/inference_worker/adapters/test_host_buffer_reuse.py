"""A payload evicted from the CPU tier gives its host buffer back; the next fetched payload is
packed into it (the hit counted in the worker's metrics)."""

from __future__ import annotations

import gc
import json

import torch

from loraserve.inference_worker.adapters import AdapterPool
from loraserve.inference_worker.coordination import InProcessCoordinator
from loraserve.inference_worker.lora import LoRASlots
from tests.helpers.lora_payloads import payload_of, random_adapter


def test_an_evicted_payloads_buffer_is_reused(tiny_model_dir) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    slots = LoRASlots(config, 1, 16, torch.float32, "cpu")
    pool = AdapterPool(slots, None, InProcessCoordinator(), max_cpu_loras=1, max_cpu_bytes=1 << 30)
    raw = [
        payload_of(random_adapter(config, {"q_proj": 8, "down_proj": 4}, seed=i), config, f"a{i}")
        for i in range(3)
    ]
    first = pool.prepare(raw[0])
    assert first.packed is not None and first.data.data_ptr() != raw[0].data.data_ptr()
    ptr = first.data.data_ptr()
    with pool.lock:
        assert pool.install(first, pool.generation("a0"))
    del first
    second = pool.prepare(raw[1])  # a0 is still in the CPU tier: a new buffer
    assert second.data.data_ptr() != ptr
    with pool.lock:
        assert pool.install(second, pool.generation("a1"))  # evicts a0
    assert "a0@" + raw[0].digest not in pool.tiers.cpu
    gc.collect()
    third = pool.prepare(raw[2])
    assert third.data.data_ptr() == ptr
    hits = pool.metrics.value("loraserve_worker_adapter_host_buffers_total", {"result": "hit"})
    misses = pool.metrics.value("loraserve_worker_adapter_host_buffers_total", {"result": "miss"})
    assert (hits, misses) == (1, 2)
