"""LoRA on the GPU (skipped without CUDA): slots filled on the device hold exactly the payload,
the Triton path agrees with the CPU reference, and decode steps replayed from CUDA graphs apply
each row's adapter exactly as eager steps do, close to transformers + peft."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.engine_logits import prefill_logits
from tests.helpers.lora_store import ADAPTER_SPECS
from tests.helpers.peft_adapters import peft_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [5, 17, 42, 99, 7, 3]


def payload_from_peft(adapter_dir, base_config: dict, dtype: str):
    from loraserve.adapter_store.checkpoint import read_checkpoint
    from loraserve.adapter_store.optimize import optimize
    from loraserve.adapter_store.validate import Limits, validate
    from loraserve.contract.payload import PayloadTensor
    from loraserve.inference_worker.lora import AdapterPayload

    ckpt = read_checkpoint(
        (adapter_dir / "adapter_config.json").read_bytes(),
        (adapter_dir / "adapter_model.safetensors").read_bytes(),
        max_tensors=4096,
    )
    opt = optimize(validate(ckpt, base_config, Limits()), base_config, dtype)
    return AdapterPayload(
        adapter_dir.name,
        opt.digest,
        opt.rank,
        opt.payload,
        [PayloadTensor(t.name, t.shape, t.dtype, t.offset, t.nbytes) for t in opt.tensors],
    )


def every_adapter_loaded(model, tiny_model_dir, lora_adapter_root, base_config, max_num_batched_tokens: int):
    """The worker's adapters for `model` with every adapter of ADAPTER_SPECS in a slot: (adapters,
    the AdaptersRunning to close)."""
    from loraserve.inference_worker.builder import build_adapters
    from loraserve.inference_worker.config import WorkerConfig
    from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource

    config = WorkerConfig(
        model=str(tiny_model_dir),
        max_loras=len(ADAPTER_SPECS),
        max_lora_rank=16,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    source = PayloadSource(
        payload_from_peft(lora_adapter_root / name, base_config, "bfloat16") for name in ADAPTER_SPECS
    )
    adapters = build_adapters(config, model, source)
    running = AdaptersRunning(adapters)
    running.load(ADAPTER_SPECS)
    return adapters, running


def test_device_slots_hold_the_payload(lora_adapter_root, base_config):
    from loraserve.inference_worker.lora import LoRASlots

    cpu = LoRASlots(base_config, 4, 16, torch.bfloat16, "cpu")
    gpu = LoRASlots(base_config, 4, 16, torch.bfloat16, "cuda")
    for slot, name in enumerate(["qv-r8", "patterned", "mlp-rs16"]):
        p = payload_from_peft(lora_adapter_root / name, base_config, "bfloat16")
        cpu.load(slot + 1, p)
        gpu.load(slot + 1, p)
    torch.cuda.synchronize()
    for g in cpu.a_all:
        assert torch.equal(cpu.a_all[g], gpu.a_all[g].cpu()) and torch.equal(cpu.b_all[g], gpu.b_all[g].cpu())
    assert torch.equal(cpu.ranks, gpu.ranks.cpu())


def test_graph_replays_apply_each_rows_adapter(tiny_model_dir, lora_adapter_root, base_config):
    from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
    from loraserve.inference_worker.engine.sequence import SamplingParams
    from loraserve.inference_worker.model.loader import load_model, load_tokenizer

    model = load_model(tiny_model_dir, torch.bfloat16, "cuda")
    adapters, running = every_adapter_loaded(model, tiny_model_dir, lora_adapter_root, base_config, 256)
    names = ["", *ADAPTER_SPECS]

    def run(graphs: bool) -> list[list[int]]:
        cfg = EngineConfig(
            max_num_seqs=8,
            max_model_len=128,
            max_num_batched_tokens=256,
            num_blocks=64,
            use_cuda_graphs=graphs,
        )
        engine = LLMEngine(model, load_tokenizer(tiny_model_dir), cfg, adapters)
        engine.runner.capture_graphs()  # what engine.start() does; this test steps the engine itself
        outs: dict[str, list[int]] = {n: [] for n in names}
        done: list[str] = []
        for n in names:

            def cb(out, n=n) -> None:
                outs[n].extend(out.token_ids)
                if out.finished:
                    done.append(n)

            engine.submit(engine.make_sequence(f"r-{n}", "", PROMPT, SamplingParams(max_tokens=8), cb, n))
        while len(done) < len(names):
            engine.step()
        return [outs[n] for n in names]

    try:
        graph, eager = run(True), run(False)
        # bf16 on the GPU against fp32 peft, by logits rather than greedy tokens: a tiny random
        # model's logits are nearly flat, so bf16 rounding can flip an argmax without any error
        engine = LLMEngine(
            model,
            load_tokenizer(tiny_model_dir),
            EngineConfig(num_blocks=64, use_cuda_graphs=False),
            adapters,
        )
        logits = prefill_logits(engine, [(n, PROMPT) for n in names]).double().cpu()
    finally:
        running.close()
    assert graph == eager
    for name, got in zip(names, logits, strict=True):
        ref = peft_reference(tiny_model_dir, lora_adapter_root / name if name else None, PROMPT, 1)[
            1
        ].double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"adapter {name!r}: relative error {err:.2e} against peft"
    assert all((row - logits[0]).abs().max() > 1e-2 for row in logits[1:])  # adapters matter
    assert sum(g != graph[0] for g in graph[1:]) >= len(names) - 2


@pytest.mark.parametrize("repeats", [8, 136])  # 64 rows (decode tiles), 1,088 (prefill tiles)
def test_shrink_beside_the_base_gemm_matches_add_lora(lora_adapter_root, base_config, repeats):
    """A LoRALayer with a side stream (the split shrink there beside the base GEMM that writes y,
    the expand after the join, PDL-launched after the GEMM with the worker's options) adds the same
    delta as `add_lora` after the GEMM, eagerly and replayed from a CUDA graph."""
    from loraserve.contract.adapter_layout import GROUPS, group_dims
    from loraserve.inference_worker.lora import LoRALayer, LoRASlots
    from loraserve.inference_worker.lora.layer import worker_launch_options
    from loraserve.kernels import LoRABatch

    slots = LoRASlots(base_config, 4, 16, torch.bfloat16, "cuda")
    for slot, name in enumerate(["qv-r8", "patterned", "mlp-rs16"]):
        slots.load(slot + 1, payload_from_peft(lora_adapter_root / name, base_config, "bfloat16"))
    token_slots = torch.tensor([1, -1, 2, 3, 1, 3, -1, 2] * repeats, dtype=torch.int32, device="cuda")
    batch = LoRABatch.allocate(len(token_slots), 4, "cuda", max_slices=3, max_rank=16)
    batch.prepare(token_slots)
    side = torch.cuda.Stream()
    options = worker_launch_options("cuda")
    for layer in (0, 1):
        for group in GROUPS:
            n_in, outs = group_dims(base_config, group)
            x = torch.randn(len(token_slots), n_in, device="cuda").to(torch.bfloat16)
            w = (torch.randn(sum(outs), n_in, device="cuda") * n_in**-0.5).to(torch.bfloat16)
            want = torch.nn.functional.linear(x, w)
            base = want.clone()
            LoRALayer(slots, layer, group.name).apply(x, want, batch)
            beside = LoRALayer(slots, layer, group.name, options, side_stream=side)

            def project_and_add(x=x, w=w, beside=beside):
                begun = beside.begin(x, batch)
                y = torch.nn.functional.linear(x, w)  # y's producer, beside the shrink
                beside.finish(x, y, batch, begun)
                return y

            got = project_and_add()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = project_and_add()
            replayed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(replayed, want, rtol=2e-2, atol=2e-2)
            assert (want.float() - base.float()).abs().max() > 0  # some adapter touches every group
            # the expand waits for the shrink's stream: held back behind a spin there, the shrink
            # ends long after the GEMM; an expand that did not wait would read the poisoned partials
            batch.workspace.fill_(float("nan"))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(5e7))
            torch.testing.assert_close(project_and_add(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("repeats", [8, 136])  # 64 rows (decode tiles), 1,088 (prefill tiles)
def test_fused_silu_mul_matches_add_lora_then_the_activation(lora_adapter_root, base_config, repeats):
    """The gate | up LoRA layer's fused expand (LoRALayer.silu_mul, the worker's launch options:
    both kernels PDL-launched right after the base GEMM that writes y) gives what add_lora and then
    the model's silu_mul kernel give, eagerly and replayed from a CUDA graph, and leaves y as it
    was; rows of every kind (three adapters, base rows) in one batch."""
    import dataclasses

    from loraserve.contract.adapter_layout import GROUPS, group_dims
    from loraserve.inference_worker.lora import LoRALayer, LoRASlots
    from loraserve.inference_worker.lora.layer import worker_launch_options
    from loraserve.inference_worker.model.fused_ops import silu_mul
    from loraserve.kernels import LoRABatch

    slots = LoRASlots(base_config, 4, 16, torch.bfloat16, "cuda")
    for slot, name in enumerate(["qv-r8", "patterned", "mlp-rs16"]):
        slots.load(slot + 1, payload_from_peft(lora_adapter_root / name, base_config, "bfloat16"))
    token_slots = torch.tensor([1, -1, 2, 3, 1, 3, -1, 2] * repeats, dtype=torch.int32, device="cuda")
    batch = LoRABatch.allocate(len(token_slots), 4, "cuda", max_slices=3, max_rank=16)
    batch.prepare(token_slots)
    (group,) = [g for g in GROUPS if g.name == "gate_up"]
    n_in, outs = group_dims(base_config, group)
    options = dataclasses.replace(worker_launch_options("cuda"), fused_silu_mul=True)
    for layer in range(2):
        fused = LoRALayer(slots, layer, "gate_up", options)
        assert fused.fuses_silu_mul(len(token_slots))
        x = torch.randn(len(token_slots), n_in, device="cuda").to(torch.bfloat16)
        w = (torch.randn(sum(outs), n_in, device="cuda") * n_in**-0.5).to(torch.bfloat16)
        y = torch.nn.functional.linear(x, w)
        want_y = y.clone()
        LoRALayer(slots, layer, "gate_up").apply(x, want_y, batch)
        want = silu_mul(want_y)
        base = silu_mul(y)
        y_before = y.clone()
        got = fused.silu_mul(x, torch.nn.functional.linear(x, w), batch)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = torch.nn.functional.linear(x, w)
            replayed = fused.silu_mul(x, y_graph, batch)
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(replayed, want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y_graph, y_before, rtol=0, atol=0)  # y itself untouched
        rows = (token_slots >= 0).nonzero().flatten()
        assert (got[rows].float() - base[rows].float()).abs().max() > 0  # the adapters changed it
        plain = (token_slots < 0).nonzero().flatten()
        assert torch.equal(got[plain], base[plain])  # base rows: exactly the plain activation


def test_a_long_prefill_step_fuses_the_gate_up_delta_and_matches_peft(
    tiny_model_dir, lora_adapter_root, base_config
):
    """A prefill step of more than FUSED_SILU_MUL_MIN_ROWS rows runs the gate | up group through
    add_lora_silu_mul (the default launch options), and each row's logits still match
    transformers + peft for its adapter, and those of a LoRA engine with the fusion off."""
    import dataclasses

    from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
    from loraserve.inference_worker.model.loader import load_model, load_tokenizer
    from loraserve.kernels import triton_ops
    from loraserve.kernels.launch_plan import FUSED_SILU_MUL_MIN_ROWS

    model = load_model(tiny_model_dir, torch.bfloat16, "cuda")
    names = ["", "mlp-rs16", "all-r4"]
    prompt = [(7 * i + 3) % 200 + 5 for i in range(400)]
    assert len(names) * len(prompt) >= FUSED_SILU_MUL_MIN_ROWS
    adapters, running = every_adapter_loaded(model, tiny_model_dir, lora_adapter_root, base_config, 2048)
    fused_launches = []
    real = triton_ops.expand_silu_mul_kernel

    class Counting:
        def __getitem__(self, grid):
            fused_launches.append(grid)
            return real[grid]

    def logits() -> torch.Tensor:
        engine = LLMEngine(
            model,
            load_tokenizer(tiny_model_dir),
            EngineConfig(num_blocks=256, max_num_batched_tokens=2048, use_cuda_graphs=False),
            adapters,
        )
        fused_launches.clear()  # whatever the engine ran while it was built
        return prefill_logits(engine, [(n, prompt) for n in names]).double().cpu()

    try:
        triton_ops.expand_silu_mul_kernel = Counting()
        fused = logits()
        triton_ops.expand_silu_mul_kernel = real
        assert len(fused_launches) == base_config["num_hidden_layers"]  # once per layer
        for module in model.grouped_linears().values():
            if module.lora is not None:
                module.lora.options = dataclasses.replace(module.lora.options, fused_silu_mul=False)
        unfused = logits()
    finally:
        triton_ops.expand_silu_mul_kernel = real
        for module in model.grouped_linears().values():
            if module.lora is not None:
                module.lora.options = dataclasses.replace(module.lora.options, fused_silu_mul=None)
        running.close()
    torch.testing.assert_close(fused, unfused, rtol=2e-2, atol=2e-2)
    for name, got in zip(names, fused, strict=True):
        ref = peft_reference(tiny_model_dir, lora_adapter_root / name if name else None, prompt, 1)[
            1
        ].double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"adapter {name!r}: relative error {err:.2e} against peft"
    assert (fused[1] - fused[0]).abs().max() > 1e-2  # the gate | up adapter matters


def test_uploads_run_beside_queued_work_and_land_after_its_reads(lora_adapter_root, base_config):
    """A load's upload runs on the copy stream while the caller's stream is still busy; the copies
    into the slot wait for the work queued before the load, which still reads the old weights;
    more loads in a row than staging buffers all land, in order."""
    from loraserve.inference_worker.lora import AdapterPayload, LoRASlots
    from loraserve.inference_worker.lora.uploads import STAGING_BUFFERS

    def pinned(name):
        p = payload_from_peft(lora_adapter_root / name, base_config, "bfloat16")
        return AdapterPayload(p.adapter_id, p.digest, p.rank, p.data.pin_memory(), p.tensors)

    def slot_one(slots):  # what a step reading slot 1 sees
        return slots.a_all["qkv"][:, 1].clone(), slots.ranks[:, :, 1].clone()

    payloads = [pinned(name) for name in ("qv-r8", "patterned", "mlp-rs16")]
    cpu = LoRASlots(base_config, 4, 16, torch.bfloat16, "cpu")
    gpu = LoRASlots(base_config, 4, 16, torch.bfloat16, "cuda")
    for p in payloads:  # each layout's copy plan and ranks made once (a blocking copy the first time)
        gpu.load(0, p)
        cpu.load(0, p)
        torch.cuda.synchronize()
    assert len(gpu.uploads._stagings) == STAGING_BUFFERS == 3  # taken in turn

    cpu.load(1, payloads[0])
    gpu.load(1, payloads[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of the caller's stream busy
    busy = torch.cuda.Event()
    busy.record()

    before = slot_one(gpu)  # queued before the load: must read the old weights
    gpu.load(1, payloads[1])
    staging = gpu.uploads._stagings[(gpu.uploads._next - 1) % STAGING_BUFFERS]  # the one it took
    deadline = time.monotonic() + 0.5
    while not staging.uploaded.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert staging.uploaded.query() and not busy.query(), "the upload waited for the work queued before it"
    with torch.cuda.stream(torch.cuda.Stream()):  # a third stream sees the bytes already there
        landed = staging.buffer[: payloads[1].nbytes].cpu()
    assert torch.equal(landed, payloads[1].data) and not busy.query()
    sequence = [(2, payloads[2]), (3, payloads[0]), (1, payloads[2]), (2, payloads[1]), (3, payloads[1])]
    for slot, p in sequence:
        gpu.load(slot, p)
    after = slot_one(gpu)
    torch.cuda.synchronize()
    assert not torch.equal(before[1], after[1])
    assert all(torch.equal(x.cpu(), y) for x, y in zip(before, slot_one(cpu), strict=True))
    cpu.load(1, payloads[1])
    for slot, p in sequence:
        cpu.load(slot, p)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(after, slot_one(cpu), strict=True))
    for g in cpu.a_all:
        assert torch.equal(cpu.a_all[g], gpu.a_all[g].cpu()) and torch.equal(cpu.b_all[g], gpu.b_all[g].cpu())
    assert torch.equal(cpu.ranks, gpu.ranks.cpu())
