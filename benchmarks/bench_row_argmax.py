"""The decode graphs' greedy choice (inference_worker/model/row_argmax.py) against torch.argmax on
float32 logits of a Llama-3 vocabulary (128,256 columns), one CUDA GPU: each captured in a CUDA
graph of 20 launches, replayed in interleaved rounds (CUDA events; median µs a launch). The outputs
are checked equal first.

    python benchmarks/bench_row_argmax.py [--rows 1,16,64,256] [--vocab 128256] [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import capture, time_graphs
from loraserve.inference_worker.model.row_argmax import row_argmax

LAUNCHES = 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_row_argmax needs a CUDA GPU", file=sys.stderr)
        return 2
    print(
        f"{torch.cuda.get_device_name()}: µs a launch, vocabulary {args.vocab}, median of {args.rounds} rounds"
    )
    print("| rows | torch.argmax | row_argmax | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for n in map(int, args.rows.split(",")):
        x = torch.randn(n, args.vocab, device="cuda").to(torch.bfloat16).float()
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        if not torch.equal(row_argmax(x, out=out), torch.argmax(x, dim=-1)):
            print(f"rows {n}: row_argmax differs from torch.argmax", file=sys.stderr)
            return 1

        def torch_argmax(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            for _ in range(LAUNCHES):
                torch.argmax(x, dim=-1, out=out)

        def ours(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            for _ in range(LAUNCHES):
                row_argmax(x, out=out)

        us = time_graphs({"torch": capture(torch_argmax), "ours": capture(ours)}, args.rounds, 10, LAUNCHES)
        print(f"| {n} | {us['torch']:.2f} | {us['ours']:.2f} | {us['ours'] / us['torch']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
