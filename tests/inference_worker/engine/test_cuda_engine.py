"""CUDA paths of the engine: the same greedy tokens on CUDA (fp32) as on CPU, and with CUDA graphs
as without (bf16), for concurrent sequences; steps timed on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.device_timing import DeviceTiming
from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams
from loraserve.inference_worker.model import launch
from loraserve.inference_worker.model.loader import load_model, load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Once",
    "0123456789 + - * /",
    "Each worker keeps the most recently used adapters in GPU slots and the rest in a CPU cache.",
]


def run(
    model_dir: Path,
    device: str,
    dtype: torch.dtype,
    graphs: bool,
    timings: list[tuple[float, float | None]] | None = None,
) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    engine = LLMEngine(
        load_model(model_dir, dtype, device),
        tok,
        EngineConfig(
            max_num_seqs=8,
            max_model_len=512,
            max_num_batched_tokens=32,
            num_blocks=128,
            use_cuda_graphs=graphs,
        ),
    )
    engine.runner.capture_graphs()  # what engine.start() does; this test steps the engine itself
    if timings is not None:
        engine.timing.observer = lambda waited, span: timings.append((waited, span))
    outs: list[list[RequestOutput]] = [[] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        engine.submit(
            engine.make_sequence(
                f"r{i}", p, [], SamplingParams(max_tokens=40 + 9 * i, ignore_eos=True), outs[i].append
            )
        )
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    if graphs:
        assert engine.runner.graphs
    if timings is not None:  # each step read back once, each timed (EVERY = 1)
        assert len(timings) == engine.num_steps
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_cuda_fp32_matches_cpu(tiny_model_dir: Path) -> None:
    assert run(tiny_model_dir, "cuda", torch.float32, graphs=True) == run(
        tiny_model_dir, "cpu", torch.float32, False
    )


def test_cuda_graphs_match_eager_bf16(tiny_model_dir: Path) -> None:
    assert run(tiny_model_dir, "cuda", torch.bfloat16, graphs=True) == run(
        tiny_model_dir, "cuda", torch.bfloat16, graphs=False
    )


def test_model_kernels_decode_alike_with_and_without_pdl(tiny_model_dir: Path) -> None:
    """The model's own kernels launched with programmatic dependent launch (the default where the
    GPU supports it, model/launch.py) decode what they decode launched plainly, eagerly and from
    graphs."""
    with_pdl = [run(tiny_model_dir, "cuda", torch.bfloat16, graphs=g) for g in (True, False)]
    with launch.pdl_off():
        plain = [run(tiny_model_dir, "cuda", torch.bfloat16, graphs=g) for g in (True, False)]
    assert with_pdl == plain


def test_steps_timed_on_the_device(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DeviceTiming, "EVERY", 1)
    timings: list[tuple[float, float | None]] = []
    run(tiny_model_dir, "cuda", torch.bfloat16, graphs=True, timings=timings)
    assert all(w >= 0 and span is not None and 0 < span < 5 for w, span in timings)
