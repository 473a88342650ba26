"""An adapter optimized in another dtype than the worker computes in: converted explicitly, with
a warning naming both dtypes and the fix, where the conversion cannot overflow; refused where it
could (into float16 from a wider range). Never rounded silently."""

from __future__ import annotations

import logging

import pytest
import torch

from loraserve.inference_worker.lora import LoRASlots
from loraserve.inference_worker.lora.slots import SlotLoadError
from tests.helpers.lora_payloads import payload_of, random_adapter


@pytest.mark.parametrize(
    "store_dtype,worker_dtype",
    [("float32", torch.bfloat16), ("bfloat16", torch.float32), ("float16", torch.bfloat16)],
)
def test_a_widening_or_store_equivalent_conversion_warns(config, store_dtype, worker_dtype, caplog) -> None:
    slots = LoRASlots(config, max_loras=2, max_rank=8, dtype=worker_dtype, device="cpu")
    ad = random_adapter(config, {"q_proj": 4}, seed=0, layers=(0,))
    payload = payload_of(ad, config, "conv", store_dtype)
    with caplog.at_level(logging.WARNING, logger="loraserve.inference_worker.lora.slots"):
        slots.load(0, payload)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    wanted = str(worker_dtype).removeprefix("torch.")
    assert store_dtype in warned[0] and wanted in warned[0] and f"--serving-dtype {wanted}" in warned[0]
    exact = payload_of(ad, config, "exact", wanted)  # what the store makes in the worker's dtype
    b = slots.b_all["qkv"][0, 0, :, :4]
    reference = LoRASlots(config, max_loras=1, max_rank=8, dtype=worker_dtype, device="cpu")
    reference.load(0, exact)
    if store_dtype == "float32":  # converted as the store would have: the same values
        assert torch.equal(b, reference.b_all["qkv"][0, 0, :, :4])
    else:
        torch.testing.assert_close(
            b.float(), reference.b_all["qkv"][0, 0, :, :4].float(), rtol=2e-2, atol=1e-2
        )


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_a_conversion_into_float16_is_refused(config, store_dtype) -> None:
    slots = LoRASlots(config, max_loras=2, max_rank=8, dtype=torch.float16, device="cpu")
    payload = payload_of(random_adapter(config, {"q_proj": 4}, seed=1, layers=(0,)), config, "x", store_dtype)
    with pytest.raises(SlotLoadError, match=f"{store_dtype}.*float16.*--serving-dtype float16"):
        slots.check(payload)


def test_the_same_dtype_loads_without_a_warning(config, caplog) -> None:
    slots = LoRASlots(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    with caplog.at_level(logging.WARNING):
        slots.load(0, payload_of(random_adapter(config, {"q_proj": 4}, seed=2, layers=(0,)), config, "y"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
