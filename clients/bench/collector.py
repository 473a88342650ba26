"""Python's garbage collector held back while a benchmark runs.

A load generator's objects of a request (its call, stream, messages, timing record, a failure's
exception) are freed by reference counts as the request ends: nothing for the collector to find
(tests/clients/test_bench.py runs the generator against workers, a router and refused requests
and finds no cycle), while each collection stops the loop that sends requests and reads streams.
Measured (benchmarks/bench_generator.py): pauses of 10-90 ms at a few hundred requests/s as a
run's records grew, which made sends late; held back, the generator sustained twice the rate.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# cycles are still collected, but only after this many more objects are held than at the start
# (what a run keeps, its records, grows by a few objects a request)
RARE_GEN0_THRESHOLD = 500_000

_lock = threading.Lock()
_depth = 0
_before: tuple[int, ...] = ()


@contextlib.contextmanager
def rare_collections(gen0_threshold: int = RARE_GEN0_THRESHOLD) -> Iterator[None]:
    """The youngest generation collected only every `gen0_threshold` net allocations inside (one
    collection first), the thresholds as they were once the last of overlapping holds has ended
    (runs of one process may overlap: the first sets, the last restores). Nothing is frozen."""
    global _depth, _before
    if gen0_threshold < 1:
        raise ValueError("gen0_threshold must be positive")
    with _lock:
        if _depth == 0:
            _before = gc.get_threshold()
            gc.collect()
            gc.set_threshold(gen0_threshold, *_before[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_before)
