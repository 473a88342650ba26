"""The gateway's one configuration object, filled from `loraserve openai --flags` and LORASERVE_*
variables (a flag beats the variable, the variable beats the default); invariants are checked at
construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraserve.clients.router import DOWN_S, REFRESH_S, REFRESH_TIMEOUT_S
from loraserve.serving.settings import config_from_args

_HELP = {
    "host": "address to listen on",
    "port": "HTTP port to listen on; 0 picks a free one and prints the bound URL",
    "worker": "inference worker address host:port: the one worker, or where the fleet starts before "
    "any worker heartbeats in Redis",
    "redis_url": "Redis URL: route by adapter residency across the workers that heartbeat there",
    "redis_prefix": "prefix of every Redis key",
    "store": "adapter store address host:port: /v1/models lists its adapters",
    "store_token": "bearer token sent to the store (ListAdapters)",
    "worker_token": "bearer token sent to the workers (Generate/GenerateStream)",
    "api_key": "bearer key clients must send (Authorization: Bearer KEY); no check when unset",
    "model_name": "the base model's name in /v1/models and `model` (default: the worker's model name)",
    "max_body_bytes": "largest request body in bytes",
    "max_prompt_chars": "largest prompt or messages text in characters",
    "max_n": "largest n, completions per request",
    "max_stop": "most stop strings per request",
    "request_timeout_s": "deadline of one generation in seconds",
    "first_message_timeout_s": "seconds a stream may wait for its first token before its worker counts "
    "as hung: the request fails (504) and the worker is left out of routing for a while (0: the "
    "request's deadline is that bound; a long queue or prefill then fails no stream before it)",
    "keep_alive_s": "seconds an idle client connection is kept open for its next request",
    "route_refresh_s": "seconds between reads of the fleet's residency and live workers",
    "worker_read_timeout_s": "bound of one read of a worker's residency in seconds; a worker whose read "
    "times out is left out of routing for --worker-down-s",
    "worker_down_s": "seconds a worker stays out of routing after it answered UNAVAILABLE, let its "
    "residency read time out or left a stream without a first token (it comes back at the first read "
    "after that)",
    "redis_timeout_s": "bound of one read of the live workers from Redis in seconds; a request that "
    "comes before the first read ended waits at most this long for it",
    "worker_connections": "connections to each worker, taken in turn by the generations (a worker with "
    "several front processes, --stream-processes, gets each connection on one of them)",
    "otlp_endpoint": "export OpenTelemetry traces over OTLP/gRPC to this URL, e.g. http://collector:4317 "
    "(tracing is off when empty; needs the otlp extra)",
    "log_level": "logging level",
}


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker: str = ""
    redis_url: str | None = None
    redis_prefix: str = "loraserve:"
    store: str = ""
    store_token: str | None = field(default=None, repr=False)
    worker_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    model_name: str = ""
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 200_000
    max_n: int = 16
    max_stop: int = 16
    request_timeout_s: float = 600.0
    first_message_timeout_s: float = 0.0
    keep_alive_s: float = 75.0
    route_refresh_s: float = REFRESH_S
    worker_read_timeout_s: float = REFRESH_TIMEOUT_S
    worker_down_s: float = DOWN_S
    redis_timeout_s: float = 2.0
    worker_connections: int = 1
    otlp_endpoint: str = ""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = []
        if not self.worker and not self.redis_url:
            problems.append("give --worker (one worker) or --redis-url (the fleet)")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is out of range")
        for name in ("max_body_bytes", "max_prompt_chars", "max_n", "max_stop", "worker_connections"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive")
        for name in (
            "request_timeout_s",
            "route_refresh_s",
            "worker_read_timeout_s",
            "worker_down_s",
            "redis_timeout_s",
            "keep_alive_s",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0")
        if self.first_message_timeout_s < 0:
            problems.append("first_message_timeout_s must be >= 0")
        if problems:
            raise ValueError("invalid gateway configuration: " + "; ".join(problems))

    def replace(self, **changes: Any) -> GatewayConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        return config_from_args(
            cls,
            argv,
            env,
            prog="loraserve openai",
            description="Serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
            "/v1/chat/completions) in front of one inference worker or the fleet. Every flag is also "
            "a LORASERVE_<FLAG> variable (--api-key is LORASERVE_API_KEY); a flag wins.",
            help=_HELP,
        )
