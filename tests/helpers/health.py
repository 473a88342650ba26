"""Health polling for the tests that hurt a server: every Check round trip while something
hostile runs, so a test can assert that health never took a second.

The poller runs in a process of its own: a server embedded in the test's process that held the
interpreter lock would stall an in-process poller too, which would then measure nothing.

    with HealthProbe(address) as probe:
        ...  # the hostile part
    assert max(probe.latencies) < 1.0
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

_ROOT = Path(__file__).resolve().parents[2]


class HealthProbe:
    def __init__(self, address: str, interval_s: float = 0.05) -> None:
        self.address, self.interval_s = address, interval_s
        self.latencies: list[float] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.health", self.address, str(self.interval_s)],
            cwd=_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the first Check answered
        assert line.strip() == "ready", f"health probe of {self.address} did not start: {line!r}"
        time.sleep(0.2)  # a few polls before the hostile part starts
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._proc is not None
        time.sleep(0.2)  # and a few after it
        out, _ = self._proc.communicate("stop\n", timeout=30)
        self.latencies = json.loads(out)


def poll(address: str, interval_s: float) -> None:
    """Poll until a line arrives on stdin, then print the round trips (a timed-out call records its
    timeout) as one JSON list."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    out: list[float] = []
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        print("ready", flush=True)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                pass
            out.append(time.monotonic() - t0)
            time.sleep(interval_s)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    poll(sys.argv[1], float(sys.argv[2]))
