"""n completions (forked KV blocks copied on the device), penalties (device-side token counts) and
logprobs on CUDA with decode graphs give what the CPU engine gives (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams
from loraserve.inference_worker.model.loader import load_model, load_tokenizer
from tests.helpers.engine_run import completions, run_request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REQUESTS = [
    ("Hello world.", SamplingParams(max_tokens=30, temperature=1.0, seed=5, n=3, ignore_eos=True)),
    (
        "The quick brown fox jumps over the lazy dog.",
        SamplingParams(
            max_tokens=40,
            n=2,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.7,
            logprobs=True,
            top_logprobs=5,
            ignore_eos=True,
        ),
    ),
    (
        "Once",
        SamplingParams(
            max_tokens=25, temperature=0.8, top_k=20, seed=9, frequency_penalty=1.0, ignore_eos=True
        ),
    ),
]


def run(model_dir: Path, device: str) -> list[list[RequestOutput]]:
    engine = LLMEngine(
        load_model(model_dir, torch.float32, device),
        load_tokenizer(model_dir),
        EngineConfig(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=32, num_blocks=64),
    )
    engine.runner.capture_graphs()  # what engine.start() does; this test steps the engine itself
    outs: list[list[RequestOutput]] = [[] for _ in REQUESTS]
    seqs = [engine.make_sequence(f"r{i}", p, [], sp, outs[i].append) for i, (p, sp) in enumerate(REQUESTS)]
    for seq in seqs[:-1]:
        engine.submit(seq)
    run_request(engine, seqs[-1], outs[-1])
    while not all(o and o[-1].last for o in outs):
        engine.step()
    if device == "cuda":
        assert engine.runner.graphs
    assert engine.num_free_blocks == 63
    return outs


def test_cuda_features_match_cpu(tiny_model_dir: Path) -> None:
    gpu, cpu = run(tiny_model_dir, "cuda"), run(tiny_model_dir, "cpu")
    for g, c in zip(gpu, cpu, strict=True):
        assert completions(g) == completions(c)
        glp = [lp for o in g for lp in o.logprobs]
        clp = [lp for o in c for lp in o.logprobs]
        assert [lp.token_id for lp in glp] == [lp.token_id for lp in clp]
        assert [lp.logprob for lp in glp] == pytest.approx([lp.logprob for lp in clp], abs=1e-3)
        assert [[t for t, _ in lp.top] for lp in glp] == [[t for t, _ in lp.top] for lp in clp]
