"""bench_step_tokens.py's pricing of a step stream (the GPU part needs CUDA graphs): steps land in
the smallest captured count that holds them, and the stream is what it says."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_step_tokens import bucket, step_stream

from loraserve.inference_worker.engine.model_runner import MIXED_GRAPH_TOKENS


def test_bucket_is_the_smallest_count_that_holds_the_step():
    counts = [64, 128, 256]
    assert [bucket(t, counts) for t in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]
    assert bucket(300, counts) == 256  # past the largest: the largest (the caller caps the stream)


def test_stream_has_decode_only_steps_and_mixed_steps_within_the_budget():
    s = step_stream(62, 0.73, (64, 256), 5000, 4096)
    zero = sum(1 for t in s if t == 0) / len(s)
    assert abs(zero - 2.718281828459045**-0.73) < 0.03  # Poisson(0.73) draws no prompt
    mixed = [t for t in s if t]
    assert min(mixed) >= 62 + 64 and max(mixed) <= 4096
    assert abs(statistics.fmean(mixed) - (62 + 160 * 0.73 / (1 - 2.718281828459045**-0.73))) < 15


def test_worker_counts_ascend_and_end_at_the_default_budget():
    assert list(MIXED_GRAPH_TOKENS) == sorted(set(MIXED_GRAPH_TOKENS))
    assert MIXED_GRAPH_TOKENS[0] == 64 and MIXED_GRAPH_TOKENS[-1] == 2048
