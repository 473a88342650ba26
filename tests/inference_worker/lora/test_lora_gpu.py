"""LoRA on the GPU (skipped without CUDA): slots filled on the device hold exactly the payload,
the Triton path agrees with the CPU reference, and decode steps replayed from CUDA graphs apply
each row's adapter exactly as eager steps do, close to transformers + peft."""

from __future__ import annotations

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
    from loraserve.inference_worker.builder import build_adapters
    from loraserve.inference_worker.config import WorkerConfig
    from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
    from loraserve.inference_worker.engine.sequence import SamplingParams
    from loraserve.inference_worker.model.loader import load_model, load_tokenizer
    from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource

    model = load_model(tiny_model_dir, torch.bfloat16, "cuda")
    config = WorkerConfig(
        model=str(tiny_model_dir), max_loras=len(ADAPTER_SPECS), max_lora_rank=16, max_num_batched_tokens=256
    )
    source = PayloadSource(
        payload_from_peft(lora_adapter_root / name, base_config, "bfloat16") for name in ADAPTER_SPECS
    )
    adapters = build_adapters(config, model, source)
    running = AdaptersRunning(adapters)
    running.load(ADAPTER_SPECS)
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


def test_shrink_beside_the_base_gemm_matches_add_lora(lora_adapter_root, base_config):
    """A LoRALayer with a side stream (shrink there, expand after the join) adds the same delta as
    `add_lora`, eagerly and replayed from a CUDA graph."""
    from loraserve.contract.adapter_layout import GROUPS, group_dims
    from loraserve.inference_worker.lora import LoRALayer, LoRASlots
    from loraserve.kernels import LoRABatch

    slots = LoRASlots(base_config, 4, 16, torch.bfloat16, "cuda")
    for slot, name in enumerate(["qv-r8", "patterned", "mlp-rs16"]):
        slots.load(slot + 1, payload_from_peft(lora_adapter_root / name, base_config, "bfloat16"))
    token_slots = torch.tensor([1, -1, 2, 3, 1, 3, -1, 2] * 8, dtype=torch.int32, device="cuda")
    batch = LoRABatch.allocate(len(token_slots), 4, "cuda", max_slices=3, max_rank=16)
    batch.prepare(token_slots)
    side = torch.cuda.Stream()
    for layer in (0, 1):
        for group in GROUPS:
            n_in, outs = group_dims(base_config, group)
            x = torch.randn(len(token_slots), n_in, device="cuda").to(torch.bfloat16)
            y0 = torch.randn(len(token_slots), sum(outs), device="cuda").to(torch.bfloat16)
            want = y0.clone()
            LoRALayer(slots, layer, group.name).apply(x, want, batch)
            beside = LoRALayer(slots, layer, group.name, side_stream=side)
            got = y0.clone()
            beside.finish(x, got, batch, beside.begin(x, batch))
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            graph, replayed = torch.cuda.CUDAGraph(), y0.clone()
            with torch.cuda.graph(graph):
                beside.finish(x, replayed, batch, beside.begin(x, batch))
            replayed.copy_(y0)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(replayed, want, rtol=2e-2, atol=2e-2)
            assert (want.float() - y0.float()).abs().max() > 0  # some adapter touches every group
