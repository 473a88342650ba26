"""The inference worker process: `create_server(config) -> (server, port)`, `start_worker`, `main`.

Drain (SIGTERM): health goes NOT_SERVING, new generations get UNAVAILABLE, running ones get
`grace_period_s` to finish, then the server stops and the engine thread ends.

Adapters: with `store_address` set and no manager passed in, the server builds one with
`inference_worker.adapters.runtime.create_adapter_manager(config, engine)` (the adapter package's
factory, see engine/adapter_hooks.py for the protocol it implements).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from loraserve.v1 import worker_pb2, worker_pb2_grpc

from clients.background import BackgroundServer
from clients.channel import bind_port
from clients.logs import configure_logging
from inference_worker.config import WorkerConfig
from inference_worker.engine.adapter_hooks import AdapterManager
from inference_worker.engine.builder import build_engine
from inference_worker.engine.engine import LLMEngine
from inference_worker.metrics import WorkerMetrics
from inference_worker.model.config import ModelConfigError
from inference_worker.service import InferenceWorkerServicer, dispatch_on

log = logging.getLogger("loraserve.worker")
SERVICE_NAME = "loraserve.v1.InferenceWorker"


class WorkerServer:
    """A grpc.aio server with its engine, health, reflection, metrics and drain."""

    def __init__(self, config: WorkerConfig, engine: LLMEngine) -> None:
        self.engine = engine
        self.adapters: AdapterManager | None = None
        self.metrics = WorkerMetrics(engine)
        self.health = health.aio.HealthServicer()
        self.grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc_server)
        self.port = bind_port(self.grpc_server, config.host, config.port, config.tls_cert, config.tls_key)
        # the bound port (port 0 picks one): the worker id and the advertised address derive from it
        self.config = config.replace(port=self.port) if config.port == 0 else config
        self.servicer = InferenceWorkerServicer(engine, self.config, self.metrics, None)
        worker_pb2_grpc.add_InferenceWorkerServicer_to_server(self.servicer, self.grpc_server)
        self.metrics_port: int | None = None

    def set_adapters(self, adapters: AdapterManager) -> None:
        """Serve adapters through this manager (before `start()`)."""
        self.adapters = self.servicer.adapters = adapters
        adapters.register_metrics(self.metrics.registry)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.adapters is not None:
            self.adapters.attach(self.engine, loop)
        self.engine.output_dispatcher = dispatch_on(loop)
        self.engine.start()
        await self.grpc_server.start()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker %s listening on %s:%d", self.config.resolved_worker_id, self.config.host, self.port)

    async def drain(self, grace: float | None = None) -> None:
        """Refuse new work, give running generations `grace` seconds, then stop."""
        grace = self.config.grace_period_s if grace is None else grace
        self.servicer.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        end = time.monotonic() + grace
        while (not self.engine.idle or self.servicer.active) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await self.stop(max(0.0, end - time.monotonic()))

    async def stop(self, grace: float | None = 0.0) -> None:
        await self.grpc_server.stop(grace)
        await asyncio.to_thread(self.engine.shutdown)
        if self.adapters is not None:
            await self.adapters.close()
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


def _adapter_manager(config: WorkerConfig, engine: LLMEngine) -> AdapterManager | None:
    if not config.store_address:
        return None
    try:
        factory = importlib.import_module("inference_worker.adapters.runtime").create_adapter_manager
    except (ImportError, AttributeError) as exc:
        raise ModelConfigError(f"store_address is set but adapters are unavailable here: {exc}") from exc
    return factory(config, engine)


def create_server(config: WorkerConfig, adapters: AdapterManager | None = None) -> tuple[WorkerServer, int]:
    """Build the engine and the server (not started: `await server.start()`); port 0 picks one."""
    engine = build_engine(config)
    server = WorkerServer(config, engine)
    if adapters is None:
        adapters = _adapter_manager(server.config, engine)
    if adapters is not None:
        engine.set_adapter_manager(adapters)
        server.set_adapters(adapters)
    return server, server.port


async def start_worker(config: WorkerConfig, adapters: AdapterManager | None = None) -> tuple[WorkerServer, int]:
    """Create and start a worker in this event loop; `await server.drain()` or `.stop()` to end it."""
    server, port = create_server(config, adapters)
    await server.start()
    return server, port


class BackgroundWorker(BackgroundServer["WorkerServer"]):
    """A worker running on its own event loop in a daemon thread (embedded default, tests).

        bg = BackgroundWorker(WorkerConfig(model=..., port=0))
        ...  # talk to bg.address
        bg.stop()      # or bg.call(bg.server.drain(5.0))
    """

    def __init__(self, config: WorkerConfig, adapters: AdapterManager | None = None) -> None:
        super().__init__(lambda: start_worker(config, adapters), config.host, "inference-worker")

    @property
    def engine(self) -> LLMEngine:
        assert self.server is not None
        return self.server.engine

    def stop(self, grace: float = 0.0) -> None:
        if self.server is not None:
            self._shutdown(self.server.stop(grace), join_s=30)


async def serve(config: WorkerConfig) -> None:
    server, _ = await start_worker(config)
    loop = asyncio.get_running_loop()
    drained = asyncio.Event()

    async def on_signal() -> None:
        log.info("draining (grace %.1fs)", config.grace_period_s)
        await server.drain()
        drained.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(on_signal()))
    await drained.wait()


def main(argv: Sequence[str] | None = None) -> int:
    config = WorkerConfig.from_args(argv)
    configure_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except ModelConfigError as exc:
        log.error("cannot start: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
