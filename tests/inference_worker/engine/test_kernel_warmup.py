"""Compile-ahead (engine/kernel_warmup.py): the eager-step mixes stay within the step's budgets and
cover the count classes Triton specializes on; warming up runs the LoRA path at every token count
and leaves the engine as it was (same tokens after as before, no KV block or slot held). On CUDA:
after the warm-up, serving-like steps of new shapes compile nothing."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.inference_worker.engine import kernel_warmup
from loraserve.inference_worker.engine.kernel_warmup import COUNT_CLASSES, step_mixes
from tests.helpers.local_worker import LocalWorker

PROMPT = [5, 17, 42, 99, 7, 3, 11]


@pytest.mark.parametrize("max_tokens,max_seqs", [(4096, 64), (256, 16), (40, 4), (8, 8)])
def test_mixes_fit_the_budgets_and_cover_the_count_classes(max_tokens, max_seqs):
    mixes = step_mixes(max_tokens, max_seqs)
    assert mixes
    for chunks, decodes in mixes:
        assert chunks and all(n >= 1 for n in chunks) and decodes >= 0
        assert sum(chunks) + decodes <= max_tokens and len(chunks) + decodes <= max_seqs
    tokens = {sum(c) + d for c, d in mixes}
    seqs = {len(c) + d for c, d in mixes}
    decodes = {d for _, d in mixes}
    for counts, limit in ((tokens, max_tokens), (seqs, max_seqs), (decodes, max_seqs - 1)):
        # every class that fits: 1, a multiple of 16, neither
        assert 1 in counts
        if limit >= 16:
            assert any(n % 16 == 0 for n in counts)
        assert any(n > 1 and n % 16 for n in counts)
    if max_seqs >= max(COUNT_CLASSES) + 1:
        assert {len(c) for c, _ in mixes} >= {1, 2, 16, 17}  # one and several prefill chunks


def test_warm_up_runs_every_token_count_and_changes_nothing(tiny_model_dir, lora_store):
    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=6, max_num_seqs=4)
    try:
        before = [w.generate(PROMPT, a, max_tokens=6)[0] for a in ("", "qv-r8", "all-r4")]
        engine = w.engine
        free_blocks = engine.num_free_blocks
        slots_before = [(s.tier, s.slot) for s in w.adapters.list_adapters()]
        calls: list[int] = []
        lora_batch = engine.runner.adapters.lora_batch

        def counting(token_slots):
            calls.append(int(token_slots.shape[0]))
            return lora_batch(token_slots)

        engine.runner.adapters.lora_batch = counting
        max_tokens = 24
        try:
            kernel_warmup.warm_up(engine.runner, max_tokens, engine.config.max_num_seqs)
        finally:
            del engine.runner.adapters.lora_batch
        # pass 1: every token count once; pass 2: one LoRA batch per eager step with adapter rows
        assert calls[:max_tokens] == list(range(1, max_tokens + 1))
        lora_steps = calls[max_tokens:]
        assert len(lora_steps) == len(step_mixes(max_tokens, engine.config.max_num_seqs))
        assert engine.num_free_blocks == free_blocks and engine.num_running == 0
        assert [(s.tier, s.slot) for s in w.adapters.list_adapters()] == slots_before
        after = [w.generate(PROMPT, a, max_tokens=6)[0] for a in ("", "qv-r8", "all-r4")]
        assert after == before
    finally:
        w.close()


def test_warm_up_runs_the_op_the_gate_up_group_runs_at_each_count(tiny_model_dir, lora_store, monkeypatch):
    """From the count where the model fuses the gate | up delta into the activation, the warm-up
    launches that op (add_lora_silu_mul) for the group, which no eager step of its own reaches."""
    from loraserve.inference_worker.lora.layer import LoRALayer

    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=6, max_num_seqs=4)
    try:
        # the fused op from 10 rows on (FUSED_SILU_MUL_MIN_ROWS is 1,024), where the model fuses it
        monkeypatch.setattr(
            LoRALayer, "fuses_silu_mul", lambda self, n: len(self.slice_offsets) == 3 and n >= 10
        )
        fused: list[tuple[str, int]] = []
        plain: list[tuple[str, int]] = []
        real_silu_mul, real_finish = LoRALayer.silu_mul, LoRALayer.finish

        def silu_mul(self, x, y, lora):
            fused.append((self.group, x.shape[0]))
            return real_silu_mul(self, x, y, lora)

        def finish(self, x, y, lora, begun):
            plain.append((self.group, x.shape[0]))
            real_finish(self, x, y, lora, begun)

        monkeypatch.setattr(LoRALayer, "silu_mul", silu_mul)
        monkeypatch.setattr(LoRALayer, "finish", finish)
        assert kernel_warmup.warm_up_lora_path(w.engine.runner, 16) == 16 * 4
        assert fused == [("gate_up", t) for t in range(10, 17)]
        assert [t for g, t in plain if g == "gate_up"] == list(range(1, 10))
        assert [t for g, t in plain if g == "qkv"] == list(range(1, 17))
    finally:
        w.close()


def _compiled_variants() -> int:
    """Compiled kernels held by every Triton JIT function of loraserve's loaded modules."""
    import sys

    import triton

    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("loraserve.") or module is None:
            continue
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.JITFunction):
                caches = getattr(obj, "device_caches", None) or {}
                total += sum(len(c[0]) for c in caches.values())
    return total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_compile_after_warm_up_for_new_step_shapes(tiny_model_dir, tmp_path):
    from loraserve.inference_worker.builder import build_worker
    from loraserve.inference_worker.config import WorkerConfig

    config = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype="bfloat16", max_num_seqs=32, max_model_len=512,
        max_num_batched_tokens=1200, num_kv_blocks=256, cuda_graphs=True, max_loras=4, max_cpu_loras=8,
        max_lora_rank=16, store_address="127.0.0.1:1",
    )  # fmt: skip
    worker = build_worker(config)
    engine = worker.engine
    kernel_warmup.warm_up(engine.runner, config.max_num_batched_tokens, config.max_num_seqs)
    engine.runner.capture_graphs()
    compiled = _compiled_variants()
    assert compiled > 0
    rng = random.Random(0)
    for _ in range(40):  # random mixes of prefill chunks and decodes, adapters and base rows
        decodes = rng.randint(0, 20)
        budget = rng.randint(8, config.max_num_batched_tokens - decodes)
        prefills = [
            (rng.randint(1, max(1, budget // 8)), rng.randint(-1, 3)) for _ in range(rng.randint(1, 8))
        ]
        decode_slots = [rng.randint(-1, 3) for _ in range(decodes)]
        sched = kernel_warmup.dummy_batch(prefills, decode_slots, config.block_size)
        engine.runner.execute(sched)
    # eager steps of 1,024 rows and more (as steps past the largest captured graph run), where the
    # gate | up group runs add_lora_silu_mul: a count that is a multiple of 16 and one that is not
    for prefills in ([(400, 0), (400, 1), (224, -1)], [(500, 0), (500, 2), (41, 1)]):
        sched = kernel_warmup.dummy_batch(prefills, [0, 1, -1], config.block_size)
        plan, _ = engine.runner.plan(sched, None)  # neither padded nor mixed: no graph replays it
        assert not plan.bucket and not plan.mixed
        engine.runner.run(plan)
    torch.cuda.synchronize()
    assert _compiled_variants() == compiled, "a step compiled a kernel the warm-up did not"


def test_short_of_device_memory_the_lora_pass_is_skipped_not_fatal(
    tiny_model_dir, lora_store, monkeypatch, caplog
):
    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=6, max_num_seqs=4)
    try:

        def no_memory(runner, max_tokens):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

        monkeypatch.setattr(kernel_warmup, "warm_up_lora_path", no_memory)
        steps: list[int] = []
        real_steps = kernel_warmup.warm_up_steps
        monkeypatch.setattr(
            kernel_warmup, "warm_up_steps", lambda *a: steps.append(real_steps(*a)) or steps[-1]
        )
        with caplog.at_level("WARNING"):
            kernel_warmup.warm_up(w.engine.runner, 16, w.engine.config.max_num_seqs)
        assert "LoRA path skipped" in caplog.text and steps and steps[0] > 0
        assert w.generate(PROMPT, "qv-r8", max_tokens=3)[1] is None  # still serves
    finally:
        w.close()


@pytest.mark.parametrize(
    "max_tokens,max_seqs,max_len", [(4096, 64, 2048), (2048, 8, 300), (600, 64, 128), (256, 4, 64)]
)
def test_large_mixes_reach_each_plan_change_within_the_budgets(max_tokens, max_seqs, max_len):
    from loraserve.kernels.launch_plan import FUSED_SILU_MUL_MIN_ROWS, PREFILL_ROWS

    mixes = kernel_warmup.large_step_mixes(max_tokens, max_seqs, max_len)
    for chunks, decodes in mixes:
        assert decodes == 0 and all(1 <= n <= max_len for n in chunks)
        assert sum(chunks) <= max_tokens and len(chunks) <= max_seqs
    totals = {sum(c) for c, _ in mixes}
    for size in (PREFILL_ROWS, FUSED_SILU_MUL_MIN_ROWS):
        for total in (size, size + 1):
            fits = total <= max_tokens and -(-total // min(max_len, 256)) <= max_seqs
            assert (total in totals) == fits, (total, totals)


def test_only_a_tensor_parallel_worker_runs_the_large_steps(tiny_model_dir, lora_store, monkeypatch):
    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=6, max_num_seqs=4)
    try:
        runner = w.engine.runner
        totals: list[int] = []
        monkeypatch.setattr(
            runner,
            "execute",
            lambda sched: totals.append(sum(n for _, n in sched.prefills) + len(sched.decodes)),
        )
        small = kernel_warmup.warm_up_steps(runner, 2048, 64, max_len=512)
        assert max(totals) < 512
        totals.clear()
        monkeypatch.setattr(runner, "sharded", True)
        large = kernel_warmup.warm_up_steps(runner, 2048, 64, max_len=512)
        assert large == small + 2 * len(kernel_warmup.large_step_mixes(2048, 64, 512))  # base and LoRA rows
        assert {512, 513, 1024, 1025} <= set(totals)
    finally:
        w.close()


def test_before_serving_warms_a_cuda_runner_at_the_engine_budgets_unless_off(monkeypatch):
    from types import SimpleNamespace

    from loraserve.inference_worker.engine.config import EngineConfig

    calls: list[tuple] = []
    monkeypatch.setattr(kernel_warmup, "warm_up", lambda *args: calls.append(args))
    cuda, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=300, max_model_len=700)
    kernel_warmup.before_serving(cuda, config)
    kernel_warmup.before_serving(cpu, config)
    kernel_warmup.before_serving(cuda, EngineConfig(kernel_warmup=False))
    assert calls == [(cuda, 300, 8, 700)]
