"""Python's garbage collector tuned for a serving process.

A decode step allocates a few objects per running sequence (its output, token lists, text
chunks); with Python's default youngest-generation threshold (700 allocations) a 256-sequence step
sets off several collections, and the older generations' collections walk every object the
process holds: the model's modules, the tokenizer, the gRPC machinery. Measured on the engine's
host work at batch 256 (benchmarks/bench_host_step.py), that is about a quarter of the step.

`tune_gc` freezes what is alive once the server is up (never collected again: it lives as long
as the process) and raises the youngest generation's threshold; cycles are still collected.
`GCPauses` times every collection: while one runs, no other thread of the process runs Python (a
step is not planned, no token is streamed), so a long one shows up in the latency tails.

A collection is timed from Python callbacks, and the first instruction of one gives the interpreter
to a thread that has asked for it for longer than the switch interval (the worker's is 0.5 ms):
after a collection longer than that, the other thread runs before the end is timed, for as long
as it keeps the interpreter. The wall-clock pause counts that time; the collecting thread's CPU time
does not (measured on a 2-core VM: youngest-generation collections of 9-21 ms wall took 5-10 ms of
CPU). Both are reported: the CPU time is what the collection itself cost.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

DEFAULT_GEN0_THRESHOLD = 10_000


def tune_gc(gen0_threshold: int = DEFAULT_GEN0_THRESHOLD) -> None:
    """Freeze the objects alive now and collect the youngest generation every `gen0_threshold`
    allocations (the older generations' ratios unchanged). Process-wide: the server's main calls it
    once it is up."""
    if gen0_threshold < 1:
        raise ValueError("gen0_threshold must be positive")
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


PYTHON_GEN0_THRESHOLD = 700


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """No garbage collection inside (one first, then none until the end; as it was after)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def python_default_gc() -> Iterator[None]:
    """Python's own collector settings inside (nothing frozen, its default youngest threshold), the
    tuned ones again after: benchmarks compare the two in one process."""
    gen0, gen1, gen2 = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(PYTHON_GEN0_THRESHOLD, gen1, gen2)
    try:
        yield
    finally:
        tune_gc(gen0)


class GCPauses:
    """Each garbage collection's wall-clock duration, by generation, to `observe(generation,
    seconds)`, and the CPU time the thread that ran it spent meanwhile to `observe_cpu` (see the
    module's text), from `gc.callbacks` (process-wide) until `close()`."""

    def __init__(
        self,
        observe: Callable[[int, float], None],
        observe_cpu: Callable[[int, float], None],
    ) -> None:
        self._observe, self._observe_cpu = observe, observe_cpu
        self._started = self._cpu_started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started, self._cpu_started = time.perf_counter(), time.thread_time()
        elif self._started:  # (a collection under way when this was added has no start)
            cpu, ended = time.thread_time(), time.perf_counter()
            self._observe(info["generation"], ended - self._started)
            self._observe_cpu(info["generation"], cpu - self._cpu_started)
            self._started = 0.0

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)
