"""The Triton kernels on a CUDA device: bf16/fp16 cases, real Llama shapes, no host sync, CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import LaunchOptions, LoRABatch, add_lora
from loraserve.kernels.batch import max_work_items
from tests.helpers.lora_cases import CASES, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_matches_float64_on_gpu(case, dtype) -> None:
    assert run_case(case, dtype, "cuda", None) == []


PDL_MODES = {"pdl-shrink": (True, True), "pdl": (True, False), "no-pdl": (False, False)}


@pytest.fixture(params=list(PDL_MODES))
def options(request) -> LaunchOptions:
    """add_lora with programmatic dependent launch of its shrink and expand, of its expand only,
    and without."""
    from loraserve.kernels import triton_ops

    pdl, pdl_shrink = PDL_MODES[request.param]
    if pdl and not triton_ops.pdl_supported(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+ and a Triton that has it")
    return LaunchOptions(pdl=pdl, pdl_shrink=pdl_shrink)


def prepare_apart(batch: LoRABatch, slots: torch.Tensor) -> None:
    """batch.prepare, then a kernel of its own: add_lora's PDL shrink must not directly follow the
    kernel that wrote its work list (LaunchOptions.pdl_shrink), as it never does in the model."""
    batch.prepare(slots)
    torch.zeros(1, device=slots.device)


def _delta64(x, lora_a, lora_b, ranks: list[int], slots: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 formula on the GPU, one slot at a time."""
    delta = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64, device=x.device)
    for slot in slots.unique().tolist():
        if slot < 0 or ranks[slot] == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        r = ranks[slot]
        xs = x[rows].double()
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            delta[rows, lo:hi] = (xs @ lora_a[slot, i, :r].double().T) @ lora_b[slot, lo:hi, :r].double().T
    return delta


def _group(num_loras: int, widths: list[int], din: int, max_rank: int, ranks: list[int], dtype: torch.dtype):
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    lora_a = torch.randn(num_loras, len(widths), max_rank, din, device="cuda").mul_(din**-0.5).to(dtype)
    lora_b = torch.randn(num_loras, offsets[-1], max_rank, device="cuda").mul_(max_rank**-0.5).to(dtype)
    for slot, r in enumerate(ranks):  # garbage past the rank must never reach a sum
        lora_a[slot, :, r:] = float("nan")
        lora_b[slot, :, r:] = float("nan")
    return lora_a, lora_b, torch.tensor(ranks, dtype=torch.int32, device="cuda"), offsets


LLAMA_GROUPS = pytest.mark.parametrize(
    "widths,din",
    [([4096, 1024, 1024], 4096), ([14336, 14336], 4096), ([4096], 14336)],
    ids=["qkv", "gate_up", "down"],
)


@pytest.mark.parametrize("num_tokens", [1, 64, 700, 2048])
@LLAMA_GROUPS
def test_llama_shapes_mixed_ranks(num_tokens, widths, din, options) -> None:
    torch.manual_seed(num_tokens + din)
    num_loras = 12
    ranks = [8, 64, 16, 1, 64, 33, 8, 0, 64, 8, 16, 64]
    lora_a, lora_b, rank_t, offsets = _group(num_loras, widths, din, 64, ranks, torch.bfloat16)
    slots = torch.randint(-1, num_loras, (num_tokens,), dtype=torch.int32, device="cuda")
    batch = LoRABatch.allocate(2048, num_loras, "cuda", max_slices=3, max_rank=64)
    batch.prepare(slots)
    x = torch.randn(num_tokens, din, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(num_tokens, offsets[-1], device="cuda", dtype=torch.bfloat16)
    y = y0.clone()
    add_lora(y, x, lora_a, lora_b, rank_t, batch, offsets, options=options)
    want = _delta64(x, lora_a, lora_b, ranks, slots, offsets)
    lora_rows = (slots >= 0) & (rank_t[slots.clamp(min=0).long()] > 0)
    assert torch.equal(y[~lora_rows], y0[~lora_rows])
    got = y[lora_rows].double() - y0[lora_rows].double()
    err = (got - want[lora_rows]).norm() / want[lora_rows].norm()
    assert err < 2e-2, float(err)


def test_prepare_and_ops_never_synchronize(options) -> None:
    lora_a, lora_b, ranks, offsets = _group(
        8, [96, 32, 32], 256, 32, [32, 8, 16, 32, 1, 8, 32, 0], torch.float16
    )
    batch = LoRABatch.allocate(256, 8, "cuda", max_slices=3, max_rank=32)
    for num_tokens in (7, 256, 0):
        slots = torch.randint(-1, 8, (num_tokens,), dtype=torch.int32, device="cuda")
        x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.float16)
        y = torch.randn(num_tokens, 160, device="cuda", dtype=torch.float16)
        prepare_apart(batch, slots)
        add_lora(y, x, lora_a, lora_b, ranks, batch, offsets, options=options)  # compile outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            prepare_apart(batch, slots)
            add_lora(y, x, lora_a, lora_b, ranks, batch, offsets, options=options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.parametrize("num_tokens", [64, 600])
def test_cuda_graph_replays_with_new_slot_assignments(num_tokens, options) -> None:
    torch.manual_seed(7)
    num_loras, din = 16, 512
    ranks = [16, 8, 64, 16, 1, 64, 8, 33, 16, 64, 8, 16, 0, 64, 16, 8]
    groups = [_group(num_loras, w, din, 64, ranks, torch.bfloat16) for w in ([512, 128, 128], [384])]
    batch = LoRABatch.allocate(num_tokens, num_loras, "cuda", max_slices=3, max_rank=64)
    slots = torch.zeros(num_tokens, dtype=torch.int32, device="cuda")
    x = torch.randn(num_tokens, din, device="cuda", dtype=torch.bfloat16)
    ys = [torch.zeros(num_tokens, off[-1], device="cuda", dtype=torch.bfloat16) for _, _, _, off in groups]

    def step() -> None:
        prepare_apart(batch, slots)
        for (lora_a, lora_b, rank_t, offsets), y in zip(groups, ys, strict=True):
            add_lora(y, x, lora_a, lora_b, rank_t, batch, offsets, options=options)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assignments = [
        torch.full((num_tokens,), 3, dtype=torch.int32),  # one adapter
        torch.randint(-1, num_loras, (num_tokens,), dtype=torch.int32),  # random, with base rows
        torch.arange(num_tokens, dtype=torch.int32) % num_loras,  # all slots, interleaved
        torch.full((num_tokens,), -1, dtype=torch.int32),  # base model only
        torch.randint(0, 2, (num_tokens,), dtype=torch.int32) * 5 + 2,  # slots 2 and 7
    ]
    for new_slots in assignments:
        slots.copy_(new_slots)
        x.copy_(torch.randn_like(x))
        y0s = [torch.randn_like(y) for y in ys]
        for y, y0 in zip(ys, y0s, strict=True):
            y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        for (lora_a, lora_b, rank_t, offsets), y, y0 in zip(groups, ys, y0s, strict=True):
            want = y0.double() + _delta64(x, lora_a, lora_b, ranks, slots, offsets)
            err = (y.double() - want).norm() / want.norm()
            assert err < 1e-2, float(err)
            base = (slots < 0) | (rank_t[slots.clamp(min=0).long()] == 0)
            assert torch.equal(y[base], y0[base])


def _step_slots(kind: str, num_loras: int, num_tokens: int) -> torch.Tensor:
    """A step's slots: uniform, all one slot, all base rows, or a few hot slots with base rows."""
    if kind == "one":
        return torch.full((num_tokens,), num_loras - 1, dtype=torch.int32, device="cuda")
    if kind == "base":
        return torch.full((num_tokens,), -1, dtype=torch.int32, device="cuda")
    if kind == "hot":
        hot = torch.tensor([-1, 0, num_loras // 2, num_loras - 1], dtype=torch.int32, device="cuda")
        return hot[torch.randint(0, 4, (num_tokens,), device="cuda")]
    return torch.randint(-1, num_loras, (num_tokens,), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("kind", ["uniform", "one", "base", "hot"])
@pytest.mark.parametrize(
    "num_loras,num_tokens",
    [(1, 64), (8, 1), (64, 64), (128, 8192), (300, 1000), (5, 0), (1024, 64), (1100, 4096), (2048, 8192)],
)
def test_triton_prepare_matches_torch_ops(num_loras, num_tokens, kind) -> None:
    """Bit for bit against the torch ops, over a batch that held another step's metadata (the
    kernel's scratch and outputs stale), launched many times: the kernel passes rows between its
    threads through global memory, so an ordering race would show as a differing launch."""
    torch.manual_seed(num_loras * 31 + num_tokens)
    slots = _step_slots(kind, num_loras, num_tokens)
    want, got = (LoRABatch.allocate(8192, num_loras, "cuda") for _ in range(2))
    want.prepare(slots, use_triton=False)
    got.prepare(_step_slots("uniform", num_loras, 4096), use_triton=True)  # stale state to overwrite
    for _ in range(50):
        got.prepare(slots, use_triton=True)
        assert torch.equal(want.sorted_rows[:num_tokens], got.sorted_rows[:num_tokens])
        assert torch.equal(want.slot_starts, got.slot_starts)
        assert torch.equal(want.slot_counts, got.slot_counts)
        for m, work in want.work.items():
            n = int(work.count)
            assert n == int(got.work[m].count)
            # slot -1, start and end 0 past the count, up to the bound the kernels launch
            bound = max(n, max_work_items(num_tokens, num_loras, m))
            for field in ("slot", "start", "end"):
                assert torch.equal(getattr(work, field)[:bound], getattr(got.work[m], field)[:bound])


@pytest.mark.parametrize("graphed", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("num_tokens", [64, 600])
def test_lora_right_after_the_base_gemm(num_tokens, graphed, options) -> None:
    """Layers as the model runs them: the base GEMM writes y, add_lora adds into it at once, the next
    layer reads it. y starts as NaN each time, so a kernel that read y before the GEMM stored it (a
    PDL launch waiting too late) shows; float32, so the chain can be checked against float64."""
    torch.manual_seed(num_tokens)
    num_loras, dim, num_layers = 8, 1024, 6
    ranks = [16, 8, 64, 16, 1, 32, 0, 64]
    layers = [_group(num_loras, [dim], dim, 64, ranks, torch.float32) for _ in range(num_layers)]
    weights = [torch.randn(dim, dim, device="cuda").mul_(dim**-0.5) for _ in range(num_layers)]
    batch = LoRABatch.allocate(num_tokens, num_loras, "cuda", max_slices=1, max_rank=64)
    slots = torch.randint(-1, num_loras, (num_tokens,), dtype=torch.int32, device="cuda")
    x = torch.randn(num_tokens, dim, device="cuda")
    ys = [torch.full((num_tokens, dim), float("nan"), device="cuda") for _ in range(num_layers)]

    def forward() -> None:
        batch.prepare(slots)
        h = x
        for (lora_a, lora_b, rank_t, offsets), w, y in zip(layers, weights, ys, strict=True):
            torch.mm(h, w.T, out=y)
            add_lora(y, h, lora_a, lora_b, rank_t, batch, offsets, options=options)
            h = y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compiles the kernels outside any capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if graphed:
        with torch.cuda.graph(graph):
            forward()
    for _ in range(3):
        slots.copy_(torch.randint(-1, num_loras, (num_tokens,), dtype=torch.int32))
        x.copy_(torch.randn_like(x))
        for y in ys:
            y.fill_(float("nan"))
        graph.replay() if graphed else forward()
        torch.cuda.synchronize()
        h = x.double()
        for (lora_a, lora_b, _, offsets), w, y in zip(layers, weights, ys, strict=True):
            h = h @ w.double().T + _delta64(h, lora_a, lora_b, ranks, slots, offsets)
            assert torch.isfinite(y).all()
            err = (y.double() - h).norm() / h.norm()
            assert err < 1e-4, float(err)
