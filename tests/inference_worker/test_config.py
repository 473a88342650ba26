"""The worker's configuration: flags beat LORASERVE_* variables beat defaults; invariants checked;
start-up problems are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.inference_worker.builder import build_worker
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.model.config import ModelConfigError


def test_flags_env_defaults(tiny_model_dir: Path) -> None:
    env = {
        "LORASERVE_MAX_NUM_SEQS": "12",
        "LORASERVE_PORT": "6000",
        "LORASERVE_CUDA_GRAPHS": "false",
        "LORASERVE_STORE_ADDRESS": "store:50051",
        "LORASERVE_MODEL": str(tiny_model_dir),
    }
    c = WorkerConfig.from_args(["--port", "7000", "--max-loras", "2", "--max-cpu-loras", "3"], env)
    assert (c.port, c.max_num_seqs, c.cuda_graphs, c.max_loras, c.max_cpu_loras) == (7000, 12, False, 2, 3)
    assert c.model == str(tiny_model_dir) and c.store_address == "store:50051" and c.block_size == 16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_loras=8, max_cpu_loras=4), "max_cpu_loras"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
        (dict(block_size=12), "block_size"),
        (dict(max_fetches=0), "max_fetches"),
        (dict(max_fetches=65), "max_fetches"),
        (dict(stream_interval=0), r"stream_interval must be in \[1, 1024\]"),
        (dict(stream_interval=1025), r"stream_interval must be in \[1, 1024\]"),
        (dict(stream_processes=0), r"stream_processes must be in \[1, 64\]"),
        (dict(stream_processes=65), r"stream_processes must be in \[1, 64\]"),
        (dict(stream_processes=2, stream_process=False), "stream_processes > 1 needs stream_process"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(tls_cert="cert.pem"), "tls_cert"),
        (dict(model=""), "model is required"),
    ],
)
def test_invariants(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**{"model": "m", **overrides})


def test_bad_env_value_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        WorkerConfig.from_args(["--model", "m"], {"LORASERVE_MAX_NUM_SEQS": "many"})


def test_a_stream_interval_past_a_requests_bound_is_a_usage_error(capsys) -> None:
    assert WorkerConfig.from_args(["--model", "m", "--stream-interval", "1024"]).stream_interval == 1024
    for argv, env in (
        (["--stream-interval", "1025"], {}),
        ([], {"LORASERVE_STREAM_INTERVAL": "100000"}),
    ):
        with pytest.raises(SystemExit) as exc:
            WorkerConfig.from_args(["--model", "m", *argv], env)
        assert exc.value.code == 2 and "stream_interval must be in [1, 1024]" in capsys.readouterr().err


def test_kv_budget_and_max_model_len(tiny_model_dir: Path) -> None:
    engine = build_worker(
        WorkerConfig(model=str(tiny_model_dir), device="cpu", kv_cache_mb=1, max_model_len=256)
    ).engine
    # 2 layers x (k, v) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert engine.config.num_blocks == (1 << 20) // 8192 and engine.config.max_model_len == 256
    with pytest.raises(ModelConfigError, match="max_position_embeddings"):
        build_worker(WorkerConfig(model=str(tiny_model_dir), device="cpu", max_model_len=10**6))


def test_start_up_errors_exit_cleanly(tmp_path: Path, caplog) -> None:
    pytest.importorskip("grpc_health")
    from loraserve.inference_worker.server import main

    assert main(["--model", str(tmp_path / "missing"), "--port", "0", "--log-level", "ERROR"]) == 2
    assert "does not exist" in caplog.text


def test_sliding_window_caps_the_length(tmp_path: Path) -> None:
    import json

    from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama

    d = write_tiny_llama(tmp_path / "mistral", TinyLlamaSpec())
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    (d / "config.json").write_text(json.dumps(cfg))
    assert (
        build_worker(WorkerConfig(model=str(d), device="cpu", kv_cache_mb=1)).engine.config.max_model_len
        == 128
    )
    with pytest.raises(ModelConfigError, match="sliding_window"):
        build_worker(WorkerConfig(model=str(d), device="cpu", kv_cache_mb=1, max_model_len=256))


def test_max_fetches_reaches_the_fetch_threads_and_look_ahead(tiny_model_dir: Path) -> None:
    from loraserve.inference_worker.builder import store_source

    flags = "--store-address 127.0.0.1:1 --max-fetches 7 --no-fetch-process --no-cuda-graphs --device cpu"
    config = WorkerConfig.from_args(["--model", str(tiny_model_dir), *flags.split()], {})
    assert store_source(config).max_fetches == 7
    adapters = build_worker(config).adapters
    assert adapters is not None
    assert adapters.ahead.max_fetches == 7
    assert adapters.pool.fetcher.gate is not None and adapters.pool.fetcher.gate.capacity == 7
