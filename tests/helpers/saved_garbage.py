"""What the garbage collector would free, for the tests that a path leaves no reference cycle
behind: with collections off and gc.DEBUG_SAVEALL set, a collection keeps what it finds unreachable
in gc.garbage instead of freeing it, and the test looks at it."""

from __future__ import annotations

import contextlib
import gc
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import loraserve.clients
import loraserve.inference_worker
from loraserve.serving.gc_tuning import no_collections

# the worker's packages (and the clients' it fetches adapters with), by module and by source file
WORKER_MODULES = ("loraserve.inference_worker.", "loraserve.clients.")
WORKER_SOURCES = tuple(
    str(Path(package.__file__).parent) + os.sep  # type: ignore[arg-type]
    for package in (loraserve.inference_worker, loraserve.clients)
)


@contextlib.contextmanager
def saving_garbage() -> Iterator[None]:
    """Collections off (one first); what a collection then finds unreachable is kept for `garbage`."""
    with no_collections():
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            yield
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.collect()


def garbage(which: Callable[[object], bool]) -> list[str]:
    """The names of what a collection now finds unreachable, among the objects `which` picks; then
    all of it is freed (cleared from gc.garbage alone, a cycle would be found again next time)."""
    gc.collect()
    found = sorted(name_of(o) for o in gc.garbage if which(o))
    gc.garbage.clear()
    gc.set_debug(0)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    return found


def of_worker(o: object) -> bool:
    """An object of the worker's code, or a frame of it."""
    if isinstance(o, types.FrameType):
        return o.f_code.co_filename.startswith(WORKER_SOURCES)
    return type(o).__module__.startswith(WORKER_MODULES)


def name_of(o: object) -> str:
    if isinstance(o, types.FrameType):
        return f"frame of {o.f_code.co_name} ({Path(o.f_code.co_filename).name})"
    return type(o).__qualname__
