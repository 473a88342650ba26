"""A busy port fails a server's start-up with one clear line (never a traceback, never a second
process sharing the port), and a server started on port 0 prints the port it bound."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from loraserve.serving.ports import PortUnavailable, listen_socket, listening_address


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORASERVE_LOG_LEVEL": "INFO"}
    return subprocess.run(
        [sys.executable, "-m", "loraserve.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def busy_port():
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_listen_socket_refuses_a_busy_port_in_one_line(busy_port: int) -> None:
    with pytest.raises(PortUnavailable) as err:
        listen_socket("127.0.0.1", busy_port)
    assert str(err.value) == f"cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    with listen_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0


def test_a_second_store_on_the_same_port_fails_to_start(store_config) -> None:
    """gRPC's SO_REUSEPORT would let both listen, and replies alternate between them."""
    from loraserve.adapter_store.server import BackgroundStore

    with BackgroundStore(store_config.replace(port=0)) as first:
        with pytest.raises(PortUnavailable, match=f":{first.port}: Address already in use"):
            BackgroundStore(store_config.replace(port=first.port))


def _one_clear_line(result: subprocess.CompletedProcess[str], port: int) -> None:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "already in use" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], result.stderr


def test_every_server_fails_start_up_on_a_busy_port_in_one_line(
    busy_port: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _one_clear_line(
        _run(
            "store",
            "--port",
            str(busy_port),
            "--base-model",
            str(tiny_model_dir),
            "--data-dir",
            str(tmp_path),
        ),
        busy_port,
    )
    _one_clear_line(
        _run("worker", "--port", str(busy_port), "--model", str(tiny_model_dir), "--device", "cpu"),
        busy_port,
    )
    _one_clear_line(_run("openai", "--port", str(busy_port), "--worker", "127.0.0.1:1"), busy_port)
    _one_clear_line(
        _run(
            "up",
            "--model",
            "tiny",
            "--once",
            "--data-dir",
            str(tmp_path / "up"),
            "--store-port",
            str(busy_port),
        ),
        busy_port,
    )


def test_servers_on_port_0_print_the_port_they_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORASERVE_LOG_LEVEL": "WARNING"}
    commands = {
        "adapter store": ["store", "--base-model", str(tiny_model_dir), "--data-dir", str(tmp_path)],
        "worker": ["worker", "--model", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "16"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "loraserve.cli", *args, "--port", "0", "--metrics-port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for name, args in commands.items()
    }
    try:
        for name, proc in procs.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith(name), line
            address = listening_address(line)  # what a caller that started it on port 0 reads
            assert address is not None and address.startswith("127.0.0.1:"), line
            assert int(address.rsplit(":", 1)[1]) > 0
            with grpc.insecure_channel(address) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            # and where its metrics are, with --metrics-port 0 too
            metrics_port = int(line.split("metrics on 127.0.0.1:")[1].split(")")[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                assert b"loraserve_" in r.read()
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
