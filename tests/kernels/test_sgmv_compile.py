"""Every Triton kernel variant the launch planner picks compiles for Hopper (sm_90) to PTX and
SASS, with no GPU: the launches of `kernels.triton_ops` and `LoRABatch.prepare` are recorded (not
run) and each recorded launch is compiled with its real argument types, constexprs and options.

The interpreter (test_sgmv_interpreter.py) checks what the kernels compute; this checks what only
the compiler sees: code paths the interpreter cannot run (grid dependency control), type rules the
interpreter does not enforce, and constexpr combinations no CPU test launches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loraserve.kernels import LaunchOptions, LoRABatch, triton_ops
from tests.helpers.triton_compile import compile_launch, record_launches, resources

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _group(num_tokens: int, num_slices: int, din: int, width: int, max_rank: int, dtype: torch.dtype):
    lora_a = torch.zeros(4, num_slices, max_rank, din, dtype=dtype)
    lora_b = torch.zeros(4, num_slices * width, max_rank, dtype=dtype)
    x = torch.zeros(num_tokens, din, dtype=dtype)
    y = torch.zeros(num_tokens, num_slices * width, dtype=dtype)
    ranks = torch.tensor([max_rank, 8, 0, 1], dtype=torch.int32)
    offsets = list(range(0, num_slices * width + 1, width))
    return y, x, lora_a, lora_b, ranks, offsets


# (rows, slices, in, slice width, buffer rank, dtype): decode and prefill tiles, ranks that keep s
# in registers or loop over it, fp32 (IEEE dots), and up to the four slices the expand takes.
SHAPES = [
    (64, 3, 4096, 1024, 16, torch.bfloat16),
    (64, 3, 4096, 1024, 32, torch.bfloat16),
    (16, 1, 4096, 4096, 128, torch.bfloat16),
    (2048, 2, 4096, 14336, 16, torch.bfloat16),
    (64, 2, 4096, 14336, 64, torch.float16),
    (7, 1, 14336, 4096, 256, torch.bfloat16),
    (600, 3, 4096, 1024, 64, torch.bfloat16),
    (600, 1, 96, 80, 256, torch.float16),
    (33, 4, 72, 40, 8, torch.float32),
]


# (pdl, pdl_shrink): plain launches; the expand launched with PDL after its shrink; both PDL, the
# shrink after whatever kernel comes before it.
PDL_MODES = {"plain": (False, False), "pdl": (True, False), "pdl-shrink": (True, True)}


@pytest.mark.parametrize("mode", list(PDL_MODES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-S{s[1]}-r{s[4]}-{TYPES[s[5]]}" for s in SHAPES])
def test_launched_variants_compile_for_hopper(monkeypatch, shape, mode) -> None:
    pdl, pdl_shrink = PDL_MODES[mode]
    num_tokens, num_slices, din, width, max_rank, dtype = shape
    launches = record_launches(monkeypatch, triton_ops, "shrink_kernel", "expand_kernel")
    monkeypatch.setattr(triton_ops, "pdl_supported", lambda device: True)  # no GPU here: sm_90 assumed
    y, x, lora_a, lora_b, ranks, offsets = _group(num_tokens, num_slices, din, width, max_rank, dtype)
    batch = LoRABatch.allocate(num_tokens, 4, "cpu", max_slices=num_slices, max_rank=max_rank)
    batch.prepare(torch.zeros(num_tokens, dtype=torch.int32))
    options = LaunchOptions(pdl=pdl, pdl_shrink=pdl_shrink)
    triton_ops.add_lora(y, x, lora_a, lora_b, ranks, batch, offsets, options=options)
    if not pdl:  # the standalone ops (never PDL)
        s = torch.zeros(num_slices, num_tokens, max_rank, dtype=torch.float32)
        triton_ops.lora_shrink(x, lora_a, ranks, batch, s)
        triton_ops.lora_expand(s, lora_b, ranks, batch, offsets, y)
    assert len(launches) == (2 if pdl else 4)
    for kernel, args, kwargs in launches:
        is_expand = kernel is triton_ops.expand_kernel.kernel
        waits = pdl and is_expand or pdl_shrink and not is_expand  # launched with PDL: waits
        triggers = pdl and not is_expand or pdl_shrink and is_expand  # lets a PDL successor start
        assert kwargs.get("launch_pdl", False) == waits
        compiled = compile_launch(kernel, args, kwargs)
        ptx = compiled.asm["ptx"]
        use = resources(compiled.asm["cubin"])
        # A spilling variant is a silent slowdown that only a GPU would show.
        assert use["STACK"] == 0 and use["LOCAL"] == 0, (kernel.fn.__name__, kwargs, use)
        assert ("griddepcontrol.wait" in ptx) == waits
        assert ("griddepcontrol.launch_dependents" in ptx) == triggers
        # The streamed operands go through cp.async (software-pipelined): x and A in the shrink;
        # B in the decode expand without preloading, which needs vector-wide rank masks (B_VEC > 1).
        streams_b = kwargs.get("B_VEC", 1) > 1 and kwargs["BLOCK_M"] == 16 and not kwargs["PRELOAD"]
        if kernel is triton_ops.shrink_kernel.kernel or streams_b:
            assert "cp.async" in ptx, (kernel.fn.__name__, kwargs)


def test_64_bit_offset_variants_compile(monkeypatch) -> None:
    launches = record_launches(monkeypatch, triton_ops, "shrink_kernel", "expand_kernel")
    monkeypatch.setattr(triton_ops, "_needs_i64", lambda *tensors: True)
    y, x, lora_a, lora_b, ranks, offsets = _group(64, 3, 256, 64, 16, torch.bfloat16)
    batch = LoRABatch.allocate(64, 4, "cpu", max_slices=3, max_rank=16)
    batch.prepare(torch.zeros(64, dtype=torch.int32))
    triton_ops.add_lora(y, x, lora_a, lora_b, ranks, batch, offsets)
    assert [kw["I64"] for _, _, kw in launches] == [True, True]
    for kernel, args, kwargs in launches:
        assert compile_launch(kernel, args, kwargs).asm["cubin"]


@pytest.mark.parametrize("max_loras", [1, 64, 300, 1024, 1100])
def test_prepare_kernel_compiles(monkeypatch, max_loras) -> None:
    import loraserve.kernels.batch_kernel as batch_kernel

    launches = record_launches(monkeypatch, batch_kernel, "prepare_kernel")
    batch = LoRABatch.allocate(512, max_loras, "cpu")
    batch.prepare(torch.zeros(100, dtype=torch.int32), use_triton=True)
    ((kernel, args, kwargs),) = launches
    assert compile_launch(kernel, args, kwargs).asm["cubin"]


# (rows, in, intermediate, buffer rank, dtype) of add_lora_silu_mul: the gate | up group of the 8B
# and 1B shapes at decode and prefill sizes, a rank that loops over s, fp32.
PAIR_SHAPES = [
    (64, 4096, 14336, 16, torch.bfloat16),
    (64, 2048, 8192, 32, torch.bfloat16),
    (64, 4096, 14336, 8, torch.float16),
    (2048, 4096, 14336, 16, torch.bfloat16),
    (2048, 4096, 14336, 32, torch.bfloat16),
    (2048, 4096, 14336, 64, torch.float16),
    (64, 4096, 14336, 64, torch.float16),
    (7, 2048, 8192, 256, torch.bfloat16),
    (600, 2048, 8192, 256, torch.bfloat16),
    (33, 72, 40, 8, torch.float32),
    (600, 72, 40, 16, torch.float32),
]


@pytest.mark.parametrize("mode", ["plain", "pdl", "pdl-shrink"])
@pytest.mark.parametrize(
    "shape", PAIR_SHAPES, ids=[f"T{s[0]}-I{s[2]}-r{s[3]}-{TYPES[s[4]]}" for s in PAIR_SHAPES]
)
def test_silu_mul_expand_compiles_for_hopper(monkeypatch, shape, mode) -> None:
    pdl, pdl_shrink = PDL_MODES[mode]
    num_tokens, din, inter, max_rank, dtype = shape
    launches = record_launches(monkeypatch, triton_ops, "shrink_kernel", "expand_silu_mul_kernel")
    monkeypatch.setattr(triton_ops, "pdl_supported", lambda device: True)
    y, x, lora_a, lora_b, ranks, _ = _group(num_tokens, 2, din, inter, max_rank, dtype)
    out = torch.zeros(num_tokens, inter, dtype=dtype)
    batch = LoRABatch.allocate(num_tokens, 4, "cpu", max_slices=2, max_rank=max_rank)
    batch.prepare(torch.zeros(num_tokens, dtype=torch.int32))
    options = LaunchOptions(pdl=pdl, pdl_shrink=pdl_shrink)
    triton_ops.add_lora_silu_mul(y, x, lora_a, lora_b, ranks, batch, out, options=options)
    assert len(launches) == 2
    kernel, args, kwargs = launches[1]
    assert kernel is triton_ops.expand_silu_mul_kernel.kernel
    assert kwargs.get("launch_pdl", False) == pdl
    compiled = compile_launch(kernel, args, kwargs)
    ptx = compiled.asm["ptx"]
    use = resources(compiled.asm["cubin"])
    assert use["STACK"] == 0 and use["LOCAL"] == 0, (kwargs, use)
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert "griddepcontrol.launch_dependents" not in ptx
