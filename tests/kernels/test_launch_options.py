"""Default launch options: programmatic dependent launch wherever the device and Triton support
it (and never elsewhere), the preloading expand only where it keeps its whole B tile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loraserve.inference_worker.lora.layer import worker_launch_options
from loraserve.kernels import LaunchOptions, LoRABatch, launch_options, launch_plan, triton_ops
from tests.helpers.triton_compile import record_launches


def test_for_device_takes_pdl_only_where_supported(monkeypatch) -> None:
    assert LaunchOptions().pdl is None  # resolved per device
    assert LaunchOptions.for_device("cpu").pdl is False
    assert LaunchOptions.for_device("cpu", pdl=True).pdl is False
    assert LaunchOptions.for_device("cpu", pdl_shrink=True).pdl_shrink is False
    assert worker_launch_options("cpu").pdl_shrink is False
    monkeypatch.setattr(launch_options, "pdl_supported", lambda device: True)
    assert LaunchOptions.for_device("cuda").pdl is True
    assert LaunchOptions.for_device("cuda", pdl=False).pdl is False
    # the shrink's PDL has a contract on add_lora's inputs: only callers that keep it ask for it
    assert LaunchOptions.for_device("cuda").pdl_shrink is False
    assert LaunchOptions.for_device("cuda", pdl_shrink=True).pdl_shrink is True
    assert LaunchOptions.for_device("cuda", pdl=False, pdl_shrink=True).pdl_shrink is False
    assert worker_launch_options("cuda").pdl_shrink is True  # its LoRA always follows a GEMM


@pytest.mark.parametrize(
    ("max_rank", "dtype", "keeps"),
    [
        (8, torch.bfloat16, True),
        (16, torch.bfloat16, True),
        (32, torch.float16, True),
        (64, torch.bfloat16, False),
        (64, torch.float32, True),
        (128, torch.float32, False),
    ],
)
def test_preload_keeps_tile(max_rank: int, dtype: torch.dtype, keeps: bool) -> None:
    elem = torch.finfo(dtype).bits // 8
    assert launch_plan.preload_keeps_tile(max_rank, elem) is keeps
    plain = launch_plan.plan_expand(64, max_rank, elem)
    preloading = launch_plan.plan_expand(64, max_rank, elem, preload=True)
    assert (preloading.block_n == plain.block_n) is keeps


@pytest.mark.parametrize(
    ("num_tokens", "max_rank", "options", "pdl", "preload"),
    [
        (64, 16, LaunchOptions(), True, True),  # decode, rank 16: PDL and the preloading expand
        (64, 64, LaunchOptions(), True, False),  # rank 64: preloading would halve the B tile
        (2048, 16, LaunchOptions(), True, False),  # prefill rows: no preload
        (64, 16, LaunchOptions(pdl=False), False, False),
        (64, 64, LaunchOptions(expand_preload=True), True, True),  # explicit choices stand
        (64, 16, LaunchOptions(pdl_shrink=True), True, True),  # the shrink launched with PDL too
    ],
)
def test_add_lora_launches_the_defaults(monkeypatch, num_tokens, max_rank, options, pdl, preload) -> None:
    launches = record_launches(monkeypatch, triton_ops, "shrink_kernel", "expand_kernel")
    monkeypatch.setattr(triton_ops, "pdl_supported", lambda device: True)  # as on sm_90
    x = torch.zeros(num_tokens, 256, dtype=torch.bfloat16)
    y = torch.zeros(num_tokens, 256, dtype=torch.bfloat16)
    lora_a = torch.zeros(2, 1, max_rank, 256, dtype=torch.bfloat16)
    lora_b = torch.zeros(2, 256, max_rank, dtype=torch.bfloat16)
    ranks = torch.tensor([max_rank, 8], dtype=torch.int32)
    batch = LoRABatch.allocate(num_tokens, 2, "cpu", max_slices=1, max_rank=max_rank)
    batch.prepare(torch.zeros(num_tokens, dtype=torch.int32))
    triton_ops.add_lora(y, x, lora_a, lora_b, ranks, batch, [0, 256], options=options)
    (_, _, shrink), (_, _, expand) = launches
    assert shrink["LAUNCH_DEPENDENTS"] is pdl and expand["WAIT_PRIOR"] is pdl
    assert expand.get("launch_pdl", False) is pdl
    # the shrink launched with PDL too (asked for): its expand then reads y after its wait
    pdl_shrink = pdl and options.pdl_shrink
    assert shrink["WAIT_PRIOR"] is pdl_shrink and shrink.get("launch_pdl", False) is pdl_shrink
    assert expand["Y_READY"] is not pdl_shrink and expand["LAUNCH_DEPENDENTS"] is pdl_shrink
    assert expand["PRELOAD"] is preload
