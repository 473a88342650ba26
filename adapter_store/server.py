"""The adapter store server: `create_server(config) -> (server, port)`, `serve`, and `main` for
`loraserve store`. grpc.aio with health checking and reflection; SIGTERM drains: health goes
NOT_SERVING, new work gets UNAVAILABLE, running streams get the grace period to finish."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.registry import Registry, SqliteRegistry
from loraserve.adapter_store.service import AdapterService
from loraserve.adapter_store.servicer import AdapterStoreServicer, add_to_server
from loraserve.adapter_store.sources import SourceResolver, boto3_s3_factory
from loraserve.serving import tracing
from loraserve.serving.background import BackgroundServer
from loraserve.serving.interceptors import BearerTokenInterceptor, ErrorStatusInterceptor
from loraserve.serving.logs import configure_logging
from loraserve.serving.observed_calls import ObservedCallInterceptor
from loraserve.serving.ports import bind_grpc_port, grpc_server
from loraserve.v1 import store_pb2

log = logging.getLogger("loraserve.store")
SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name
# the RPCs that change the registry; they need the admin token when one is configured
ADMIN_METHODS = (f"/{SERVICE_NAME}/RegisterAdapter", f"/{SERVICE_NAME}/DeleteAdapter")
# the RPCs that read adapters (weights included); they need the read token, or the admin token,
# when a read token is configured
READ_METHODS = (
    f"/{SERVICE_NAME}/FetchAdapter",
    f"/{SERVICE_NAME}/GetAdapter",
    f"/{SERVICE_NAME}/ListAdapters",
)
# Replies: room for a 1 MiB chunk plus framing, and for large manifests. Requests are ids and
# sources: 4 MiB bounds what a client can make the store parse.
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 4 << 20)]


def open_registry(config: StoreConfig, metrics: StoreMetrics | None = None) -> Registry:
    """SQLite in the data directory, or Redis with a copy there to restore it from when Redis loses it
    (its restores counted in `metrics`)."""
    if config.redis_url:
        from loraserve.adapter_store.registry_mirror import MirroredRegistry
        from loraserve.adapter_store.registry_redis import RedisRegistry

        return MirroredRegistry(
            RedisRegistry(config.redis_url, config.redis_prefix, adopt=False),
            SqliteRegistry(Path(config.data_dir) / "registry-copy.sqlite3"),
            metrics=metrics,
        )
    return SqliteRegistry(Path(config.data_dir) / "registry.sqlite3")


@dataclass
class StoreServer:
    """A created (not yet started) store: the grpc.aio server and what it serves."""

    server: grpc.aio.Server
    service: AdapterService
    health: Any
    config: StoreConfig
    metrics: StoreMetrics
    _metrics_http: Any = field(default=None, repr=False)

    async def start(self) -> None:
        await self.server.start()
        self.service.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            self._metrics_http = self.metrics.serve(self.config.metrics_port)

    @property
    def metrics_port(self) -> int | None:
        """The Prometheus endpoint's bound port (--metrics-port 0 picks one); None when off."""
        return None if self._metrics_http is None else int(self._metrics_http.server_port)

    async def begin_drain(self) -> None:
        """Health NOT_SERVING and UNAVAILABLE for new work; running streams go on."""
        self.service.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self, grace: float | None = None) -> None:
        """Stop taking work, let running streams finish within the grace period, then stop."""
        await self.begin_drain()
        await self.server.stop(self.config.grace_period_s if grace is None else grace)
        self.close()

    async def stop(self, grace: float | None = 0) -> None:
        await self.server.stop(grace)
        self.close()

    def close(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http = None
        self.service.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def create_server(config: StoreConfig) -> tuple[StoreServer, int]:
    """Build the store for `config` and bind its port (0 picks a free one); call start() next."""
    base_config = config.load_base_config()
    config.root.mkdir(parents=True, exist_ok=True)
    metrics = StoreMetrics()
    resolver = SourceResolver(
        config.root, boto3_s3_factory(config.s3_endpoint_url, config.s3_region, config.s3_timeout_s)
    )
    service = AdapterService(config, base_config, open_registry(config, metrics), resolver, metrics)
    if config.otlp_endpoint:
        tracing.enable_otlp(config.otlp_endpoint, "loraserve-store")
    interceptors = [
        ObservedCallInterceptor(
            "store", quiet={"ListAdapters"}
        ),  # outermost: sees the status the caller gets
        BearerTokenInterceptor(
            {method: config.admin_token for method in ADMIN_METHODS}
            | {
                method: (config.read_token, config.admin_token) if config.read_token else None
                for method in READ_METHODS
            }
        ),
        ErrorStatusInterceptor(log),
    ]
    server = grpc_server(interceptors, GRPC_OPTIONS)
    add_to_server(AdapterStoreServicer(service, config.chunk_bytes), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = bind_grpc_port(server, config.host, config.port, config.tls_cert, config.tls_key)
    return StoreServer(server, service, health_servicer, config, metrics), port


async def serve(config: StoreConfig) -> None:
    store, port = create_server(config)
    await store.start()
    line = (
        f"adapter store listening on {config.host}:{port} "
        f"(registry: {'redis' if config.redis_url else 'sqlite'}, adapter root: {config.root}, "
        f"disk tier: {config.payload_cache_dir or 'off'}"
        + (f", metrics on {config.host}:{store.metrics_port}" if store.metrics_port is not None else "")
        + ")"
    )
    log.info("%s", line)
    print(line, flush=True)  # the bound ports, whatever the log level (port 0 picks one)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    waiter = asyncio.ensure_future(store.wait_for_termination())
    await asyncio.wait([waiter, asyncio.ensure_future(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
    if stopping.is_set():
        log.info("draining (grace %.1fs)", config.grace_period_s)
        await store.drain()
    waiter.cancel()


class BackgroundStore(BackgroundServer["StoreServer"]):
    """A store running on its own event loop in a daemon thread (embedded default, tests)."""

    def __init__(self, config: StoreConfig) -> None:
        async def start() -> tuple[StoreServer, int]:
            store, port = create_server(config)
            await store.start()
            return store, port

        super().__init__(start, config.host, "adapter-store")

    @property
    def store(self) -> StoreServer | None:
        return self.server

    @property
    def service(self) -> AdapterService:
        assert self.server is not None
        return self.server.service

    def stop(self, grace: float | None = 0, drain: bool = False) -> None:
        if self.server is not None:
            self._shutdown(self.server.drain(grace) if drain else self.server.stop(grace), join_s=10)

    def __enter__(self) -> BackgroundStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    config = StoreConfig.from_args(argv)
    configure_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except (ValueError, OSError) as exc:  # PortUnavailable included: one line, no traceback
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
