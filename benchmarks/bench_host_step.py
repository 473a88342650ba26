"""The host work of one engine step, without a GPU: what a decode step costs the step thread
besides the model (scheduling, planning the batch, sampling bookkeeping, detokenization, output).

The engine runs a tiny model on the CPU whose runner returns fixed logits instead of calling the
model, over a small vocabulary, so the tensor ops cost about what launching them costs on a GPU
and what is left is the step's Python. On a GPU this work overlaps the device's step (asynchronous
scheduling) only while it is shorter: at Llama-3.2-1B batch 256 it was not (overhead.md).

    python benchmarks/bench_host_step.py [--batch 256] [--steps 200] [--profile 25] [--text-in-front]
    python benchmarks/bench_host_step.py --plan [--batch 64]   (planning a step alone)
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer
from loraserve.serving.gc_tuning import python_default_gc, tune_gc

VOCAB = 512
PROMPT_LEN = 128


@functools.cache
def _fixed_logits(vocab: int) -> torch.Tensor:
    return torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))


def fixed_logits_run(
    runner: ModelRunner, plan: StepPlan, prev_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """`ModelRunner.run` without the model: the step's inputs go to the device as in the real
    runner, and the logits are fixed rows over the model's vocabulary."""
    runner.to_device(plan)
    return _fixed_logits(runner.model.config.vocab_size)[: plan.num_sampled]


class FixedLogitsRunner(ModelRunner):
    """Plans every step as the real runner does, then answers fixed logits instead of the model."""

    run = fixed_logits_run


def make_engine(batch: int, max_len: int) -> LLMEngine:
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": max_len,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "eos_token_id": VOCAB - 1,
        },
        name="host-step",
    )
    model = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    block_size = 16
    config = EngineConfig(
        max_num_seqs=batch,
        max_model_len=max_len,
        max_num_batched_tokens=8192,
        block_size=block_size,
        num_blocks=batch * (max_len // block_size) + 1,
        max_queue_size=batch,
        use_cuda_graphs=False,
    )
    engine = LLMEngine(model, word_tokenizer(VOCAB), config)
    engine.runner = FixedLogitsRunner(
        model, config.num_blocks, block_size, batch, max_len, use_cuda_graphs=False
    )
    return engine


def per_step(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def plan_times(batch: int, reps: int = 300, rounds: int = 5) -> None:
    """ModelRunner.plan alone, median of `rounds` (us a call): a decode step of `batch` sequences
    (prompt 256, 40 tokens out), and a step with two 256-token prefill chunks beside batch - 2."""
    engine = make_engine(batch, 1024)
    seqs = []
    for i in range(batch + 2):
        prompt = [(i * 7 + j) % (VOCAB - 1) for j in range(256)]
        seq = engine.make_sequence(f"r{i}", "", prompt, SamplingParams(max_tokens=64), lambda out: None)
        engine.blocks.allocate(seq, 256 + 40)
        seqs.append(seq)
    decodes, prefills = seqs[:batch], seqs[batch:]
    for seq in decodes:
        seq.output_token_ids.extend(range(40))
        seq.num_computed_tokens = 256 + 39
    cases = {
        f"decode step, {batch} sequences": (ScheduledBatch(decodes=decodes), batch, None),
        f"two 256-token prefill chunks and {batch - 2} decodes": (
            ScheduledBatch(prefills=[(s, 256) for s in prefills], decodes=decodes[:-2]),
            None,
            512 + batch,
        ),
    }
    for label, (sched, pad_to, mixed) in cases.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                engine.runner.plan(sched, pad_to, mixed)
            times.append((time.perf_counter() - t0) / reps * 1e6)
        print(
            f"plan, {label}: {statistics.median(times):.1f} us (min {min(times):.1f}, max {max(times):.1f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="decode steps timed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, help="print this many functions of a cProfile run")
    p.add_argument(
        "--text-in-front",
        action="store_true",
        help="sequences with tokens only (the relay's front makes the text)",
    )
    p.add_argument("--plan", action="store_true", help="time ModelRunner.plan alone, then stop")
    a = p.parse_args()
    if a.plan:
        plan_times(a.batch)
        return
    max_len = PROMPT_LEN + (2 * a.rounds + 1) * a.steps + 16
    engine = make_engine(a.batch, max_len)
    g = torch.Generator().manual_seed(1)
    outs = [0] * a.batch  # outputs are counted and dropped, as the service sends them on

    def receiver(i: int):
        def on_output(_out: object) -> None:
            outs[i] += 1

        return on_output

    for i in range(a.batch):
        ids = torch.randint(0, VOCAB - 1, (PROMPT_LEN,), generator=g).tolist()
        params = SamplingParams(
            max_tokens=max_len - PROMPT_LEN, ignore_eos=True, detokenize=not a.text_in_front
        )
        engine.submit(engine.make_sequence(f"r{i}", "", ids, params, receiver(i)))
    while not all(outs):
        engine.step()
    tune_gc()  # the worker's settings; each round also runs with Python's default collector
    tuned: list[float] = []
    default: list[float] = []
    for _ in range(a.rounds):
        tuned.append(per_step(engine, a.steps))
        with python_default_gc():
            default.append(per_step(engine, a.steps))
    for label, times in (("worker GC settings", tuned), ("Python's default GC", default)):
        print(
            f"batch {a.batch}{', text in front' if a.text_in_front else ''}, {label}: host ms per decode step {statistics.median(times):.3f} "
            f"(min {min(times):.3f}, max {max(times):.3f}) over {a.rounds} rounds of {a.steps}"
        )
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)


if __name__ == "__main__":
    main()
