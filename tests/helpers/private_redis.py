"""A private redis-server for tests that stop, freeze or restart Redis without touching anyone
else's: on a free port, with an append-only file in its own directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.ports import free_port


class PrivateRedis:
    """A real redis-server of our own, so that it can be stopped without touching anyone else's."""

    def __init__(
        self, directory: Path, options: Sequence[str] = ("--save", "", "--appendonly", "yes")
    ) -> None:
        """`options`: redis-server's, but --port, --bind and --dir (this server's own)."""
        self.port, self.dir, self.proc = free_port(), directory, None
        self.options = list(options)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                *self.options,
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server is killed too
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections stay open and nothing is answered, as a hung Redis behaves."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
