"""The store's one configuration object, filled from `loraserve store --flags` and LORASERVE_* variables.

Every field `name` has a flag `--name` (dashes) and a variable `LORASERVE_NAME`; a flag beats the
variable, the variable beats the default. Invariants are checked at construction.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraserve.contract.adapter_layout import CHUNK_SIZE, DTYPES
from loraserve.serving.settings import SERVER_HELP, config_from_args

_HELP = {
    **SERVER_HELP,
    "data_dir": "store data directory (the SQLite registry, or with Redis the copy of its registry)",
    "adapter_root": "local sources must resolve inside this directory (default DATA_DIR/adapters)",
    "base_model": "base model directory holding config.json (or the config.json itself)",
    "base_model_name": "name adapters must declare as base_model_name_or_path (default: the config's)",
    "check_base_model": "refuse adapters whose base_model_name_or_path names another model",
    "serving_dtype": "dtype of the optimized tensors: keep it the workers' compute dtype (a worker converts another with a "
    "warning, and refuses one into float16)",
    "max_lora_rank": "largest LoRA rank accepted",
    "max_adapter_bytes": "largest adapter_model.safetensors accepted, in bytes",
    "max_tensors": "largest number of tensors in one checkpoint",
    "cache_max_adapters": "CPU cache bound: number of optimized adapters",
    "cache_max_bytes": "CPU cache bound: bytes of optimized adapters",
    "cache_dir": "disk tier of optimized adapters, read on a CPU cache miss instead of rebuilding from the "
    "source; kept across restarts (default DATA_DIR/payload-cache; an empty value turns the tier off)",
    "cache_dir_max_bytes": "disk tier bound: bytes of its files (least recently used go first)",
    "handover_dir": "directory shared with workers on this host (a tmpfs such as /dev/shm/...): a worker that "
    "shares it (its --store-handover-dir) gets payloads as files written there instead of streams; the store "
    "owns it (made when it is not there; no other user may write into it) and removes its files at start-up "
    "(unset: every fetch streams)",
    "handover_max_bytes": "hand-over directory bound: bytes of its files (least recently handed over go first)",
    "max_pending_registrations": "registrations in flight before RESOURCE_EXHAUSTED",
    "chunk_bytes": "FetchAdapter chunk size (at most 1 MiB)",
    "redis_url": "Redis URL for the registry (copied to DATA_DIR; else SQLite in DATA_DIR)",
    "redis_prefix": "prefix of every Redis key the store writes",
    "s3_endpoint_url": "S3 endpoint URL (MinIO, moto); default from the AWS configuration",
    "s3_region": "S3 region; default from the AWS configuration",
    "s3_timeout_s": "S3 connect/read timeout in seconds",
    "admin_token": "bearer token required by RegisterAdapter and DeleteAdapter (and accepted by the reads)",
    "read_token": "bearer token required by FetchAdapter, GetAdapter and ListAdapters; workers present it as "
    "their store token (reads are open when unset)",
    "grace_period_s": "seconds running streams get to finish on SIGTERM",
}


@dataclass(frozen=True)
class StoreConfig:
    base_model: str
    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: str = ".loraserve-store"
    adapter_root: str | None = None
    base_model_name: str | None = None
    check_base_model: bool = False
    serving_dtype: str = "bfloat16"
    max_lora_rank: int = 64
    max_adapter_bytes: int = 2 << 30
    max_tensors: int = 4096
    cache_max_adapters: int = 32
    cache_max_bytes: int = 4 << 30
    cache_dir: str | None = None  # None: DATA_DIR/payload-cache; "": no disk tier
    cache_dir_max_bytes: int = 16 << 30
    handover_dir: str | None = None
    handover_max_bytes: int = 4 << 30
    max_pending_registrations: int = 16
    chunk_bytes: int = CHUNK_SIZE
    redis_url: str | None = None
    redis_prefix: str = "loraserve:"
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_timeout_s: float = 10.0
    admin_token: str | None = field(default=None, repr=False)
    read_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_port: int | None = None
    otlp_endpoint: str = ""
    grace_period_s: float = 10.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = []
        if not self.base_model:
            problems.append("base_model is required (a directory holding config.json)")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is out of range")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port {self.metrics_port} is out of range")
        if self.serving_dtype not in DTYPES:
            problems.append(f"serving_dtype must be one of {DTYPES}, not {self.serving_dtype!r}")
        if not 1 <= self.max_lora_rank <= 1024:
            problems.append("max_lora_rank must be in [1, 1024]")
        if not 1 <= self.chunk_bytes <= CHUNK_SIZE:
            problems.append(f"chunk_bytes must be in [1, {CHUNK_SIZE}]")
        for name in (
            "max_adapter_bytes",
            "max_tensors",
            "cache_max_adapters",
            "cache_max_bytes",
            "cache_dir_max_bytes",
            "handover_max_bytes",
            "max_pending_registrations",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive")
        if self.grace_period_s < 0 or self.s3_timeout_s <= 0:
            problems.append("grace_period_s must be >= 0 and s3_timeout_s > 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key go together")
        if not re.fullmatch(r"[A-Za-z0-9:._{}-]*", self.redis_prefix):
            problems.append(f"redis_prefix {self.redis_prefix!r} has characters outside [A-Za-z0-9:._{{}}-]")
        tier = self.payload_cache_dir
        if tier is not None and tier.resolve() in (Path(self.data_dir).resolve(), self.root.resolve()):
            problems.append(
                f"cache_dir {tier} must be a directory of its own, not the data dir or adapter root"
            )
        if self.handover_dir:
            shared = Path(self.handover_dir).resolve()
            taken = [Path(self.data_dir), self.root] + ([tier] if tier is not None else [])
            inside_root = shared.is_relative_to(self.root.resolve())  # the operator's checkpoints
            if inside_root or any(shared == p.resolve() or p.resolve().is_relative_to(shared) for p in taken):
                problems.append(
                    f"handover_dir {self.handover_dir} must be a directory of its own (the store removes its files there "
                    "at start-up), not the data dir, adapter root or disk tier, nor above them, nor in the "
                    "adapter root"
                )
        if problems:
            raise ValueError("invalid store configuration: " + "; ".join(problems))

    @property
    def root(self) -> Path:
        return Path(self.adapter_root) if self.adapter_root else Path(self.data_dir) / "adapters"

    @property
    def payload_cache_dir(self) -> Path | None:
        """The disk tier's directory; None when the tier is off."""
        if self.cache_dir is None:
            return Path(self.data_dir) / "payload-cache"
        return Path(self.cache_dir) if self.cache_dir else None

    def base_config_path(self) -> Path:
        p = Path(self.base_model)
        return p / "config.json" if p.is_dir() else p

    def load_base_config(self) -> dict:
        path = self.base_config_path()
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the base model config {path}: {exc}") from exc
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in config
        ]
        if missing:
            raise ValueError(f"base model config {path} lacks {missing}")
        return config

    def expected_base_model_name(self, base_config: dict) -> str:
        return self.base_model_name or base_config.get("_name_or_path") or self.base_config_path().parent.name

    def replace(self, **changes: Any) -> StoreConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> StoreConfig:
        return config_from_args(
            cls,
            argv,
            env,
            prog="loraserve store",
            description="Run the adapter store service.",
            help=_HELP,
            required=("base_model",),
            choices={"serving_dtype": DTYPES},
        )
