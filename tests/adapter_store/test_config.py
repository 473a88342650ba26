"""StoreConfig from flags and LORASERVE_* variables, with its invariants."""

from __future__ import annotations

import pytest

from loraserve.adapter_store.config import StoreConfig


def test_flags_beat_env_beat_defaults() -> None:
    env = {
        "LORASERVE_BASE_MODEL": "/m",
        "LORASERVE_PORT": "7000",
        "LORASERVE_MAX_LORA_RANK": "32",
        "LORASERVE_CHECK_BASE_MODEL": "true",
        "LORASERVE_REDIS_URL": "redis://r:6379/0",
        "LORASERVE_ADMIN_TOKEN": "zz-secret",
    }
    cfg = StoreConfig.from_args(["--port", "7001", "--no-check-base-model", "--cache-max-bytes", "1000"], env)
    assert (cfg.base_model, cfg.port, cfg.max_lora_rank, cfg.check_base_model) == ("/m", 7001, 32, False)
    assert (
        cfg.redis_url == "redis://r:6379/0" and cfg.admin_token == "zz-secret" and cfg.cache_max_bytes == 1000
    )
    assert cfg.serving_dtype == "bfloat16" and cfg.metrics_port is None
    assert "zz-secret" not in repr(cfg)


@pytest.mark.parametrize(
    "changes,problem",
    [
        ({"base_model": ""}, "base_model is required"),
        ({"chunk_bytes": 2 << 20}, "chunk_bytes"),
        ({"serving_dtype": "int8"}, "serving_dtype"),
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key"),
        ({"cache_max_adapters": 0}, "cache_max_adapters must be positive"),
        ({"port": 70000}, "port 70000"),
        ({"redis_prefix": "a b"}, "redis_prefix"),
        ({"cache_dir_max_bytes": 0}, "cache_dir_max_bytes must be positive"),
        ({"data_dir": "/d", "cache_dir": "/d/"}, "cache_dir /d must be a directory of its own"),
        ({"adapter_root": "/a", "cache_dir": "/a"}, "not the data dir or adapter root"),
    ],
)
def test_invariants(changes: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        StoreConfig(**{"base_model": "/m", **changes})


def test_bad_flag_values_exit(capsys) -> None:
    with pytest.raises(SystemExit):
        StoreConfig.from_args(["--base-model", "/m", "--serving-dtype", "int8"], {})
    assert "--serving-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        StoreConfig.from_args([], {"LORASERVE_BASE_MODEL": "/m", "LORASERVE_CHECK_BASE_MODEL": "maybe"})
    assert "LORASERVE_CHECK_BASE_MODEL='maybe' is not a boolean" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        StoreConfig.from_args([], {"LORASERVE_BASE_MODEL": "/m", "LORASERVE_MAX_LORA_RANK": "sixteen"})
    assert "LORASERVE_MAX_LORA_RANK='sixteen' is not a valid int" in capsys.readouterr().err


def test_disk_tier_settings() -> None:
    base = {"LORASERVE_BASE_MODEL": "/m", "LORASERVE_DATA_DIR": "/var/lib/loraserve"}
    cfg = StoreConfig.from_args([], base)
    assert (
        str(cfg.payload_cache_dir) == "/var/lib/loraserve/payload-cache"
        and cfg.cache_dir_max_bytes == 16 << 30
    )
    cfg = StoreConfig.from_args(
        ["--cache-dir-max-bytes", "1000"], {**base, "LORASERVE_CACHE_DIR": "/var/cache/loraserve"}
    )
    assert str(cfg.payload_cache_dir) == "/var/cache/loraserve" and cfg.cache_dir_max_bytes == 1000
    assert StoreConfig.from_args([], {**base, "LORASERVE_CACHE_DIR": ""}).payload_cache_dir is None
    assert StoreConfig.from_args(["--cache-dir", ""], base).payload_cache_dir is None
