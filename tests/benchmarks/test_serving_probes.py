"""The serving benchmark's CPU probe: shares of a core by process and by the worker's threads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving_probes import ProcessCpu

# a stand-in worker: two threads busy for a while, and a child process busy too
WORKER = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.time() + 4\\nwhile time.time() < end: pass"])
def spin(seconds):
    end = time.time() + seconds
    while time.time() < end:
        pass
t = threading.Thread(target=spin, args=(4,))
t.start()
time.sleep(4)  # the main thread idles
t.join()
child.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_shares_by_process_and_by_the_workers_busiest_threads() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER])
    try:
        time.sleep(0.5)
        with ProcessCpu(worker.pid, window_s=5) as cpu:
            time.sleep(1.5)  # the load ends first: so does the window
        got = cpu.summary(threads=2)
    finally:
        worker.kill()
        worker.wait()
    # one thread spun (the interpreter's lock lets it run alone), the main thread slept
    assert 0.3 <= got["worker"] <= 1.5  # (wide: a loaded host lends the spinning thread less)
    busiest, second = got["worker_busiest_threads"]
    assert busiest >= 0.3 and second <= 0.25
    # its child is the worker's; the worker itself is not counted again among this process's children
    (child,) = got[f"worker's {Path(sys.executable).name}"]  # (named by its executable)
    assert 0.3 <= child <= 1.5
    assert not any(k.startswith("benchmark's") and k.endswith(f" {worker.pid}") for k in cpu._first)
    assert 1.4 <= cpu._wall < 3


def test_an_unfinished_window_says_nothing() -> None:
    assert ProcessCpu(1, window_s=1).summary() == {}
