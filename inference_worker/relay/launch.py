"""Starting and stopping the worker's front process (front.py): it binds the public address first
(the worker id and the address the worker advertises derive from the bound port), then connects
to the relay socket once the worker has loaded its model and listens there."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from loraserve.serving.ports import PortUnavailable

log = logging.getLogger("loraserve.worker")
STOP_WAIT_S = 5.0


class FrontProcess:
    def __init__(
        self, host: str, port: int, core_address: str, tls_cert: str | None = None, tls_key: str | None = None
    ) -> None:
        """Starts the front and waits until it listens; raises PortUnavailable when it cannot."""
        self._directory = Path(tempfile.mkdtemp(prefix="loraserve-relay-"))  # 0700: ours alone
        self.socket_path = str(self._directory / "relay.sock")
        args = ["--host", host, "--port", str(port), "--core", core_address, "--socket", self.socket_path]
        if tls_cert and tls_key:
            args += ["--tls-cert", tls_cert, "--tls-key", tls_key]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.inference_worker.relay.front", *args],
            stdin=subprocess.PIPE,  # held open while this process lives: the front ends with it
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self.stop()
            message = line.removeprefix("error ") or f"the front process exited ({self.proc.returncode})"
            raise PortUnavailable(message)
        self.port = int(line.split()[1])
        self._stopping = False

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """`on_exit(returncode)` (on a watcher thread) if the front ends before `stop`."""

        def wait() -> None:
            code = self.proc.wait()
            if not self._stopping:
                on_exit(code)

        threading.Thread(target=wait, name="relay-front-watch", daemon=True).start()

    def stop(self, exit_within: float = 0.0) -> None:
        """End the front: it may first exit on its own within `exit_within` seconds (it does once
        the worker has closed the relay socket and its calls have ended), else its stdin is closed,
        which stops it at once; killed if it has not ended within STOP_WAIT_S."""
        self._stopping = True
        if exit_within > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(exit_within)
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the front's signal to stop (it ignores SIGTERM)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self._directory, ignore_errors=True)
