"""CUDA-graph timing shared by the GPU benchmarks: a callable captured in a graph (run once outside
the capture first, so Triton compiles and allocations happen there), a graph's replay time, and
several graphs timed in interleaved rounds (each round starts at the next graph, so drift and
clock changes fall on all of them alike). All times are CUDA-event times in µs."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """µs per replay of `graph` (CUDA events around `reps` replays, after one)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def round_times(
    graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int, per: int = 1
) -> dict[str, list[float]]:
    """Each graph's µs per replay / `per` (per layer, per launch), one value a round."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(replay_us(graphs[name], replays) / per)
    return times


def time_graphs(
    graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int, per: int = 1
) -> dict[str, float]:
    """round_times' median per graph."""
    return {name: statistics.median(t) for name, t in round_times(graphs, rounds, replays, per).items()}
