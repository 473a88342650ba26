"""Slot buffers and LoRA layers: a payload lands in its slot with no transform, and each row
gets exactly its own adapter's delta (float64 oracle)."""

from __future__ import annotations

import itertools

import pytest
import torch

from loraserve.contract.adapter_layout import GROUPS, MODULES, group_dims
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.lora import AdapterPayload, LoRALayer, LoRASlots
from loraserve.inference_worker.lora.slots import SlotLoadError
from loraserve.kernels import LoRABatch
from tests.helpers.lora_payloads import payload_of, random_adapter


def test_load_copies_payload_into_slot(config):
    slots = LoRASlots(config, max_loras=3, max_rank=16, dtype=torch.float32, device="cpu")
    ad = random_adapter(config, {"q_proj": 4, "v_proj": 8, "down_proj": 2}, seed=0, layers=(1,))
    p = payload_of(ad, config, "x")
    slots.load(2, p)
    a = slots.a[1]["qkv"][2]  # [3, R, in]
    assert torch.equal(a[:, :8], p.view(next(t for t in p.tensors if t.name == "layers.1.qkv.lora_a")))
    b = slots.b[1]["qkv"][2]  # [N, R]
    assert torch.equal(b[:, :8], p.view(next(t for t in p.tensors if t.name == "layers.1.qkv.lora_b")))
    ranks = {(layer, g.name): int(slots.group_ranks(layer, g.name)[2]) for layer in (0, 1) for g in GROUPS}
    assert ranks == {
        (0, "qkv"): 0,
        (0, "o"): 0,
        (0, "gate_up"): 0,
        (0, "down"): 0,
        (1, "qkv"): 8,
        (1, "o"): 0,
        (1, "gate_up"): 0,
        (1, "down"): 2,
    }
    slots.clear(2)
    assert int(slots.ranks.abs().sum()) == 0


def test_check_rejects_what_does_not_fit(config):
    slots = LoRASlots(config, max_loras=2, max_rank=4, dtype=torch.float32, device="cpu")
    big = payload_of(random_adapter(config, {"q_proj": 8}, seed=1), config, "big")
    with pytest.raises(SlotLoadError, match="rank 8"):
        slots.check(big)
    ok = payload_of(random_adapter(config, {"o_proj": 4}, seed=2), config, "ok")
    bad_name = AdapterPayload(
        "n", ok.digest, 4, ok.data, [PayloadTensor("layers.0.lm_head.lora_a", (1, 4, 64), "float32", 0, 1024)]
    )
    with pytest.raises(SlotLoadError, match="not part of the adapter layout"):
        slots.check(bad_name)
    t = ok.tensors[0]
    wrong_shape = AdapterPayload(
        "w", ok.digest, 4, ok.data, [PayloadTensor(t.name, (1, 4, 65), t.dtype, 0, 1040)]
    )
    with pytest.raises(SlotLoadError, match="does not fit"):
        slots.check(wrong_shape)
    with pytest.raises(SlotLoadError, match="layer 7"):
        slots.check(
            AdapterPayload(
                "l",
                ok.digest,
                4,
                ok.data,
                [PayloadTensor("layers.7.o.lora_a", t.shape, t.dtype, 0, t.nbytes)],
            )
        )


def test_adapters_of_one_layout_share_a_plan_and_each_lands_in_its_slot(config):
    """The copy plan is made once per layout (rank and module set): a second adapter of the same
    layout reuses it and still lands its own weights; a layout that does not fit is still refused
    after a fitting one was planned, and another rank gets its own plan and ranks."""
    slots = LoRASlots(config, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    mods = {"q_proj": 4, "down_proj": 4}
    first, second = (payload_of(random_adapter(config, mods, seed=s), config, f"a{s}") for s in (3, 4))
    slots.load(0, first)
    slots.load(1, second)
    assert second.copy_plan is not None and second.copy_plan[0] is first.copy_plan[0]
    for slot, p in ((0, first), (1, second)):
        want = p.view(next(t for t in p.tensors if t.name == "layers.0.down.lora_b"))
        assert torch.equal(slots.b[0]["down"][slot][:, :4], want)
    too_big = payload_of(random_adapter(config, {"q_proj": 16}, seed=5), config, "big")
    with pytest.raises(SlotLoadError, match="rank 16"):
        slots.check(too_big)
    other = payload_of(random_adapter(config, {"q_proj": 8}, seed=6), config, "r8")
    slots.load(2, other)
    assert other.copy_plan[0] is not first.copy_plan[0]
    assert [int(slots.group_ranks(0, g)[2]) for g in ("qkv", "down")] == [8, 0]
    assert [int(slots.group_ranks(0, g)[1]) for g in ("qkv", "down")] == [4, 4]


def test_layer_applies_each_rows_adapter(config):
    """y += delta of the row's slot, per PEFT's math: scale * (x @ A_i.T) @ B_i.T per slice."""
    slots = LoRASlots(config, max_loras=4, max_rank=16, dtype=torch.float32, device="cpu")
    adapters = {
        0: random_adapter(config, {"q_proj": 4, "k_proj": 2, "v_proj": 8, "up_proj": 16}, seed=3),
        1: random_adapter(config, dict.fromkeys(MODULES, 3), seed=4, rslora=True),
        3: random_adapter(config, {"gate_proj": 5, "down_proj": 7, "o_proj": 1}, seed=5, layers=(1,)),
    }
    for slot, ad in adapters.items():
        slots.load(slot, payload_of(ad, config, f"a{slot}"))
    token_slots = torch.tensor([0, -1, 1, 3, 0, 1, -1, 3, 3], dtype=torch.int32)
    batch = LoRABatch.allocate(16, 4, "cpu", max_slices=3, max_rank=16)
    batch.prepare(token_slots)
    g = torch.Generator().manual_seed(9)
    for layer, group in itertools.product((0, 1), GROUPS):
        n_in, outs = group_dims(config, group)
        x = torch.randn(len(token_slots), n_in, generator=g)
        y0 = torch.randn(len(token_slots), sum(outs), generator=g)
        y = y0.clone()
        LoRALayer(slots, layer, group.name).apply(x, y, batch)
        want = y0.double()
        for t, s in enumerate(token_slots.tolist()):
            if s < 0:
                continue
            offsets = list(itertools.accumulate(outs, initial=0))
            for i, m in enumerate(group.slices):
                mod = adapters[s].modules.get((layer, m))
                if mod is not None:
                    delta = (x[t].double() @ mod.a.double().T) @ (mod.b.double() * mod.scale).T
                    want[t, offsets[i] : offsets[i + 1]] += delta
        torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


def test_bytes_needed_matches_allocation(config):
    slots = LoRASlots(config, max_loras=3, max_rank=8, dtype=torch.bfloat16, device="cpu")
    allocated = sum(t.nbytes for t in (*slots.a_all.values(), *slots.b_all.values()))
    assert LoRASlots.bytes_needed(config, 3, 8, torch.bfloat16) == allocated == 3 * slots.slot_bytes()


def test_payload_inside_a_larger_buffer(config):
    """A payload whose bytes are a view into a bigger (reused) buffer lands the same."""
    ad = random_adapter(config, {"q_proj": 4, "o_proj": 4, "up_proj": 2}, seed=7)
    p = payload_of(ad, config, "x")
    big = torch.zeros(p.nbytes + 4096, dtype=torch.uint8)
    big[128 : 128 + p.nbytes] = p.data
    shifted = AdapterPayload("x", p.digest, p.rank, big[128 : 128 + p.nbytes], p.tensors)
    a = LoRASlots(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    b = LoRASlots(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    a.load(1, p)
    b.load(1, shifted)
    for g in a.a_all:
        assert torch.equal(a.a_all[g], b.a_all[g]) and torch.equal(a.b_all[g], b.b_all[g])
    assert a.a_all["qkv"].abs().sum() > 0


def test_gate_up_silu_mul_applies_the_delta_before_the_activation(config):
    """GroupedLinear.silu_mul with a LoRA layer that fuses (forced on: CPU runs the reference op)
    gives what forward and then silu(gate) * up give; where the layer does not fuse (the default
    at decode sizes, or the option off) it runs exactly that."""
    import dataclasses

    from loraserve.inference_worker.model.forward_batch import ForwardBatch
    from loraserve.inference_worker.model.linear import GroupedLinear
    from loraserve.kernels import LaunchOptions
    from loraserve.kernels.launch_plan import FUSED_SILU_MUL_MIN_ROWS

    slots = LoRASlots(config, max_loras=4, max_rank=16, dtype=torch.float32, device="cpu")
    slots.load(1, payload_of(random_adapter(config, {"gate_proj": 4, "up_proj": 8}, seed=3), config, "a1"))
    slots.load(2, payload_of(random_adapter(config, {"up_proj": 5}, seed=4), config, "a2"))
    token_slots = torch.tensor([1, -1, 2, 1, 2, -1, 1], dtype=torch.int32)
    lora = LoRABatch.allocate(8, 4, "cpu", max_slices=3, max_rank=16)
    lora.prepare(token_slots)
    n_in, outs = group_dims(config, next(g for g in GROUPS if g.name == "gate_up"))
    inter = outs[0]
    linear = GroupedLinear(0, "gate_up", n_in, list(outs), False, torch.float32, "cpu")
    linear.weight.copy_(torch.randn(sum(outs), n_in, generator=torch.Generator().manual_seed(1)) * 0.1)
    x = torch.randn(len(token_slots), n_in, generator=torch.Generator().manual_seed(2))
    empty = torch.empty(0, dtype=torch.int32)
    batch = ForwardBatch(x, empty, empty, empty, empty, empty, token_slots, lora=lora)
    calls: list[int] = []

    def activation(y: torch.Tensor) -> torch.Tensor:
        calls.append(y.shape[0])
        gate, up = y.split(inter, dim=-1)
        return torch.nn.functional.silu(gate) * up

    layer = LoRALayer(slots, 0, "gate_up")
    linear.lora = layer
    want = activation(linear(x, batch))
    plain = activation(torch.nn.functional.linear(x, linear.weight))
    assert not layer.fuses_silu_mul(len(token_slots))  # the default at a decode-sized step
    assert layer.fuses_silu_mul(FUSED_SILU_MUL_MIN_ROWS)
    calls.clear()
    torch.testing.assert_close(linear.silu_mul(x, batch, activation), want, rtol=0, atol=0)
    assert calls == [len(token_slots)]  # not fused: forward, then the activation
    layer.options = dataclasses.replace(LaunchOptions(), fused_silu_mul=True)
    calls.clear()
    got = linear.silu_mul(x, batch, activation)
    assert calls == []  # fused: the op made the activation itself
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got - plain)[token_slots >= 0].abs().max() > 1e-3  # the adapters changed those rows
    torch.testing.assert_close(got[token_slots < 0], plain[token_slots < 0], rtol=1e-6, atol=1e-7)
    layer.options = dataclasses.replace(LaunchOptions(), fused_silu_mul=False)
    assert not layer.fuses_silu_mul(FUSED_SILU_MUL_MIN_ROWS)
    o_layer = LoRALayer(slots, 0, "o", dataclasses.replace(LaunchOptions(), fused_silu_mul=True))
    assert not o_layer.fuses_silu_mul(FUSED_SILU_MUL_MIN_ROWS)  # one slice: nothing to fuse with


class FakeStaging:
    """Stands in for uploads.Staging (CUDA events and memory) to check the buffers' policy on CPU."""

    made: list[int] = []  # sizes, in order
    fail: bool = False

    def __init__(self, nbytes: int, device: torch.device, copy_stream: object) -> None:
        if FakeStaging.fail:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        self.buffer, self.views = torch.empty(nbytes, dtype=torch.uint8), {}
        FakeStaging.made.append(nbytes)


@pytest.fixture
def staging_policy(monkeypatch):
    """(the uploads of a CUDA worker with a copy stream, as they take staging buffers; free bytes)."""
    from loraserve.inference_worker.lora import uploads as uploads_module

    free = {"bytes": 1 << 40}
    monkeypatch.setattr(uploads_module, "Staging", FakeStaging)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    FakeStaging.made, FakeStaging.fail = [], False
    uploads = uploads_module.Uploads(torch.device("cpu"), copy_stream=False)
    uploads._max = uploads_module.STAGING_BUFFERS
    return uploads, free


def turns(uploads, n: int, nbytes: int = 100) -> list[int]:
    """Which buffer (its place in uploads._stagings) each of `n` loads takes."""
    return [uploads._stagings.index(uploads._take(nbytes)) for _ in range(n)]


def test_staging_buffers_are_taken_in_turn_and_grow(staging_policy):
    uploads, _ = staging_policy
    assert turns(uploads, 4) == [0, 1, 2, 0] and FakeStaging.made == [100, 100, 100]  # made once
    first = list(uploads._stagings)
    first[1].views[(0, ())] = ([], [])
    grown = uploads._take(500)  # the second, too small: replaced (its views go with it)
    assert grown is not first[1] and grown.buffer.numel() == 500 and grown.views == {}
    assert uploads._stagings == [first[0], grown, first[2]]
    assert turns(uploads, 2, 50) == [2, 0]


def test_no_more_staging_buffers_than_free_memory_allows(staging_policy, caplog):
    uploads, free = staging_policy
    free["bytes"] = 300  # the first buffer is always made; a second needs 4 x 100 bytes free
    with caplog.at_level("WARNING"):
        assert turns(uploads, 4) == [0, 0, 0, 0]
    assert FakeStaging.made == [100] and "loads share 1" in caplog.text


def test_an_out_of_memory_past_the_first_buffer_shares_the_ones_made(staging_policy):
    uploads, _ = staging_policy
    assert turns(uploads, 2) == [0, 1]
    FakeStaging.fail = True
    assert turns(uploads, 4) == [0, 1, 0, 1]  # the third could not be made: two in turn
    assert len(uploads._stagings) == 2


def test_a_failed_first_buffer_is_made_by_the_next_load(staging_policy):
    uploads, _ = staging_policy
    FakeStaging.fail = True
    with pytest.raises(torch.OutOfMemoryError):  # no buffer at all: this load fails (reported)
        uploads._take(100)
    FakeStaging.fail = False
    assert turns(uploads, 4) == [0, 1, 2, 0] and len(uploads._stagings) == 3
    assert len({id(s) for s in uploads._stagings}) == 3
