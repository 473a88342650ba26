"""`loraserve openai` as a process: --port 0 prints the bound URL, which serves; a configuration
without a worker or a Redis URL is refused with a usage error."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from loraserve.gateway.config import GatewayConfig


def test_port_0_prints_the_url_it_serves(gateway_worker) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve", "openai", "--port", "0", "--worker", gateway_worker.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("OpenAI-compatible API on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].split("/v1", 1)[0]
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert models[0]["object"] == "model"  # the worker's base model, no store given
    finally:
        proc.terminate()
        # uvicorn shuts down, then re-raises the signal it caught (the parent sees SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)


def test_config_needs_a_worker_or_redis() -> None:
    with pytest.raises(ValueError, match="--worker"):
        GatewayConfig()
    with pytest.raises(SystemExit):
        GatewayConfig.from_args([], env={})
    cfg = GatewayConfig.from_args(["--worker", "w:1"], env={"LORASERVE_API_KEY": "k", "LORASERVE_MAX_N": "4"})
    assert (cfg.worker, cfg.api_key, cfg.max_n) == ("w:1", "k", 4)
