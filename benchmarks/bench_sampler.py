"""Sampling cost per step: the batched sampler against a per-row loop (one set of ops per sampling
row, each with its own generator: how sampling is often written), same inputs, same device; then
what penalties (device-side token counts) and top-20 logprobs add to a batched step.

    python benchmarks/bench_sampler.py [--vocab 128256] [--device cuda]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from loraserve.inference_worker.engine.sampler import Sampler
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.text_stream import TextStream


def per_row_loop(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
) -> list[int]:
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[0]:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            s, order = torch.sort(row, descending=True)
            probs = s.softmax(-1)
            row = row.scatter(0, order, s.masked_fill((probs.cumsum(-1) - probs) >= p.top_p, float("-inf")))
        e = torch.empty_like(row).exponential_(generator=gens[i])
        tokens[i] = (row.softmax(-1) / e).argmax()
    return tokens.tolist()


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()  # .tolist() at the end of each call synchronizes
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.machine()} CPU"
    print(f"device: {name}; vocab {args.vocab}; torch {torch.__version__}")
    mixes = {
        "temperature 0.8": SamplingParams(temperature=0.8),
        "top_k 50": SamplingParams(temperature=0.8, top_k=50),
        "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    }
    print("| batch | params | per-row loop ms | batched ms | speedup |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for batch in (16, 64, 256):
        logits = torch.randn(batch, args.vocab, device=dev) * 3
        for label, p in mixes.items():
            params = [SamplingParams(**{**p.__dict__, "seed": i}) for i in range(batch)]
            seqs = [
                Sequence(
                    request_id=str(i),
                    prompt_token_ids=[1],
                    params=params[i],
                    on_output=lambda _: None,
                    text_stream=TextStream(None),
                )
                for i in range(batch)
            ]
            gens = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]
            sampler = Sampler()
            loop = timed(lambda: per_row_loop(logits, params, gens), dev, args.repeats)  # noqa: B023
            batched = timed(lambda: sampler.sample(logits, seqs), dev, args.repeats)  # noqa: B023
            print(f"| {batch} | {label} | {loop:.2f} | {batched:.2f} | {loop / batched:.1f}x |")
    extras = {
        "temperature 0.8": SamplingParams(temperature=0.8),
        "+ all three penalties": SamplingParams(
            temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
        ),
        "+ logprobs, top 20": SamplingParams(temperature=0.8, logprobs=True, top_logprobs=20),
    }
    print()
    print("| batch | params | batched ms |")
    print("| ---: | --- | ---: |")
    for batch in (16, 64, 256):
        logits = torch.randn(batch, args.vocab, device=dev) * 3
        for label, p in extras.items():
            seqs = [
                Sequence(
                    request_id=str(i),
                    prompt_token_ids=list(range(i, i + 512)),  # penalties see a 512-token prompt
                    params=SamplingParams(**{**p.__dict__, "seed": i}),
                    on_output=lambda _: None,
                    text_stream=TextStream(None),
                )
                for i in range(batch)
            ]
            sampler = Sampler()
            ms = timed(lambda: sampler.step(logits, seqs), dev, args.repeats)  # noqa: B023
            print(f"| {batch} | {label} | {ms:.2f} |")


if __name__ == "__main__":
    main()
