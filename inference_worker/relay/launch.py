"""Starting and stopping the worker's front processes (front.py): the first binds the public address
(the worker id and the address the worker advertises derive from the bound port), the others join
it; each connects to the relay socket once the worker has loaded its model and listens there."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from loraserve.serving.ports import PortUnavailable

log = logging.getLogger("loraserve.worker")
STOP_WAIT_S = 5.0


class FrontProcess:
    """The worker's front: `count` processes serving the public port (the first binds it, the
    others join it with SO_REUSEPORT, and the kernel spreads the clients' connections over them),
    each connecting to the one relay socket. `proc` is the first of `procs`."""

    def __init__(
        self,
        host: str,
        port: int,
        core_address: str,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        count: int = 1,
    ) -> None:
        """Starts the fronts and waits until they listen; raises PortUnavailable when one cannot."""
        self._directory = Path(tempfile.mkdtemp(prefix="loraserve-relay-"))  # 0700: ours alone
        self.socket_path = str(self._directory / "relay.sock")
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        args = ["--host", host, "--core", core_address, "--socket", self.socket_path]
        if tls_cert and tls_key:
            args += ["--tls-cert", tls_cert, "--tls-key", tls_key]
        if count > 1:
            args.append("--share-port")
        self.port = self._listening(self._spawn([*args, "--port", str(port)]))
        joining = [self._spawn([*args, "--port", str(self.port), "--joining"]) for _ in range(count - 1)]
        for proc in joining:  # started together, then each waited for
            self._listening(proc)

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[0]

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.inference_worker.relay.front", *args],
            stdin=subprocess.PIPE,  # held open while this process lives: the front ends with it
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def _listening(self, proc: subprocess.Popen) -> int:
        """The port `proc` listens on, from its first line; else every front stops, and
        PortUnavailable says why."""
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self.stop()
            message = line.removeprefix("error ") or f"the front process exited ({proc.returncode})"
            raise PortUnavailable(message)
        return int(line.split()[1])

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """`on_exit(returncode)` (on a watcher thread) if a front ends before `stop`."""

        def wait(proc: subprocess.Popen) -> None:
            code = proc.wait()
            if not self._stopping:
                on_exit(code)

        for proc in self.procs:
            threading.Thread(target=wait, args=(proc,), name="relay-front-watch", daemon=True).start()

    def stop(self, exit_within: float = 0.0) -> None:
        """End the fronts: each may first exit on its own within `exit_within` seconds (it does once
        the worker has closed the relay socket and its calls have ended), else its stdin is closed,
        which stops it at once; killed if it has not ended within STOP_WAIT_S."""
        self._stopping = True
        if exit_within > 0:
            end = time.monotonic() + exit_within
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, end - time.monotonic()))
        for proc in self.procs:  # all told at once, then waited for, within one deadline
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # the front's signal to stop (it ignores SIGTERM)
        end = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        shutil.rmtree(self._directory, ignore_errors=True)
