"""The plain-torch twins against the float64 formula, and the argument checks of every op."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import LoRABatch, add_lora, add_lora_begin, add_lora_finish, lora_expand, lora_shrink
from tests.helpers.lora_cases import CASES, run_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_matches_float64(case, dtype) -> None:
    assert run_case(case, dtype, "cpu", None) == []


def _setup(num_tokens: int = 4, din: int = 8, num_loras: int = 2, slices: int = 2, rank: int = 4, n: int = 6):
    batch = LoRABatch.allocate(8, num_loras, "cpu", max_slices=slices, max_rank=rank)
    batch.prepare(torch.tensor([0, -1, 1, 0][:num_tokens], dtype=torch.int32))
    x = torch.randn(num_tokens, din)
    lora_a = torch.randn(num_loras, slices, rank, din)
    lora_b = torch.randn(num_loras, n, rank)
    ranks = torch.full((num_loras,), rank, dtype=torch.int32)
    y = torch.randn(num_tokens, n)
    s = torch.empty(slices, num_tokens, rank)
    return batch, x, lora_a, lora_b, ranks, y, s


def test_shrink_rejects_bad_arguments() -> None:
    backend = None
    batch, x, lora_a, _, ranks, _, s = _setup()
    with pytest.raises(TypeError, match="lora_a dtype"):
        lora_shrink(x, lora_a.half(), ranks, batch, s, backend=backend)
    with pytest.raises(TypeError, match="out must be float32"):
        lora_shrink(x, lora_a, ranks, batch, s.half(), backend=backend)
    with pytest.raises(ValueError, match="in_features"):
        lora_shrink(x[:, :7].contiguous(), lora_a, ranks, batch, s, backend=backend)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(torch.randn(8, 4).T, lora_a, ranks, batch, s, backend=backend)
    with pytest.raises(ValueError, match="prepared for"):
        lora_shrink(x[:3], lora_a, ranks, batch, s[:, :3], backend=backend)
    with pytest.raises(TypeError, match="ranks must be int32"):
        lora_shrink(x, lora_a, ranks.long(), batch, s, backend=backend)
    with pytest.raises(ValueError, match="out must have shape"):
        lora_shrink(x, lora_a, ranks, batch, s[:1], backend=backend)
    with pytest.raises(TypeError, match="LoRABatch"):
        lora_shrink(x, lora_a, ranks, object(), s, backend=backend)  # type: ignore[arg-type]


def test_expand_and_add_lora_reject_bad_arguments() -> None:
    batch, x, lora_a, lora_b, ranks, y, s = _setup()
    with pytest.raises(ValueError, match="slice_offsets needs"):
        lora_expand(s, lora_b, ranks, batch, [0, 6], y)
    with pytest.raises(ValueError, match="end at N"):
        lora_expand(s, lora_b, ranks, batch, [0, 3, 5], y)
    with pytest.raises(ValueError, match="strictly increasing"):
        lora_expand(s, lora_b, ranks, batch, [0, 0, 6], y)
    with pytest.raises(TypeError, match="lora_b dtype"):
        lora_expand(s, lora_b.bfloat16(), ranks, batch, [0, 3, 6], y)
    with pytest.raises(ValueError, match="columns"):
        lora_expand(s, lora_b, ranks, batch, [0, 3, 6], y[:, :5].contiguous())
    with pytest.raises(ValueError, match="rank dimension"):
        lora_expand(s[..., :3].contiguous(), lora_b, ranks, batch, [0, 3, 6], y)
    with pytest.raises(ValueError, match="slots"):
        add_lora(y, x, lora_a, lora_b[:1], ranks, batch, [0, 3, 6])
    with pytest.raises(ValueError, match="backend must be"):
        add_lora(y, x, lora_a, lora_b, ranks, batch, [0, 3, 6], backend="cuda")


def test_add_lora_in_two_calls_checks_that_they_belong_together() -> None:
    batch, x, lora_a, lora_b, ranks, y, _ = _setup()
    want = add_lora(y.clone(), x, lora_a, lora_b, ranks, batch, [0, 3, 6])
    with pytest.raises(TypeError, match="lora_a dtype"):
        add_lora_begin(x, lora_a.half(), ranks, batch)
    begun = add_lora_begin(x, lora_a, ranks, batch)
    with pytest.raises(TypeError, match="what add_lora_begin returned"):
        add_lora_finish(object(), y, lora_b, ranks, batch, [0, 3, 6])  # type: ignore[arg-type]
    other = LoRABatch.allocate(8, 2, "cpu", max_slices=2, max_rank=4)
    other.prepare(torch.tensor([0, -1, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="the batch its add_lora_begin got"):
        add_lora_finish(begun, y, lora_b, ranks, other, [0, 3, 6])
    with pytest.raises(ValueError, match="slots"):
        add_lora_finish(begun, y, lora_b[:1], ranks, batch, [0, 3, 6])
    with pytest.raises(ValueError, match="rank dimension"):
        add_lora_finish(begun, y, lora_b[..., :3].contiguous(), ranks, batch, [0, 3, 6])
    got = y.clone()
    add_lora_finish(begun, got, lora_b, ranks, batch, [0, 3, 6])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="finished already"):
        add_lora_finish(begun, got, lora_b, ranks, batch, [0, 3, 6])
    torch.testing.assert_close(got, want)  # nothing added twice


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch, x, lora_a, _, ranks, _, s = _setup()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        lora_shrink(x, lora_a, ranks, batch, s, backend="triton")


def test_prepare_checks_its_input() -> None:
    batch = LoRABatch.allocate(4, 3, "cpu")
    with pytest.raises(TypeError, match="int32"):
        batch.prepare(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="max_tokens"):
        batch.prepare(torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="must lie in"):
        batch.prepare(torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        batch.prepare(torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("seed", range(6))
def test_prepare_builds_grouped_rows_and_work_lists(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_loras = int(torch.randint(1, 9, (1,), generator=gen))
    num_tokens = int(torch.randint(0, 150, (1,), generator=gen))
    slots = torch.randint(-1, num_loras, (num_tokens,), generator=gen, dtype=torch.int32)
    batch = LoRABatch.allocate(160, num_loras, "cpu")
    batch.prepare(torch.full((7,), 0, dtype=torch.int32))  # stale state must not survive
    batch.prepare(slots)
    assert batch.num_tokens == num_tokens
    rows = batch.sorted_rows[:num_tokens].tolist()
    assert sorted(rows) == list(range(num_tokens))
    counts = batch.slot_counts.tolist()
    starts = batch.slot_starts.tolist()
    for slot in range(num_loras):
        want = [t for t in range(num_tokens) if slots[t] == slot]
        assert rows[starts[slot] : starts[slot] + counts[slot]] == want
    for block_m, work in batch.work.items():
        items = []
        for slot in range(num_loras):
            for first in range(0, counts[slot], block_m):
                items.append((slot, starts[slot] + first, starts[slot] + counts[slot]))
        n = int(work.count)
        assert n == len(items) and n <= work.capacity
        got = list(zip(work.slot[:n].tolist(), work.start[:n].tolist(), work.end[:n].tolist(), strict=True))
        assert got == items
        assert (work.slot[n:] == -1).all()
