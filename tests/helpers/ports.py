"""Ports on the loopback for the services a test starts: `free_port` for a server a test must
restart on the same address; otherwise a service binds port 0 and `await_listening` reads the
address it bound from its "listening on HOST:PORT" line (no port picked beforehand for another
process to take first)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from loraserve.serving.ports import listening_address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def await_listening(log: Path, proc: subprocess.Popen, timeout: float = 90.0) -> str:
    """host:port of the first "listening on" line `proc` wrote to `log`; raises if it exits or
    `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if address := listening_address(text):
            return address
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening:\n{text[-2000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"no 'listening on' line in {log} after {timeout}s")
