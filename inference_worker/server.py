"""The inference worker process: `create_server(config) -> (server, port)`, `start_worker`, `main`.

Drain (SIGTERM): health goes NOT_SERVING, new generations get UNAVAILABLE, running ones get
`grace_period_s` to finish, then the server stops and the engine thread ends.

Failure (a tensor-parallel rank died, or a collective with the ranks failed or timed out): the
worker can no longer compute, so every generation, running or queued, ends at once with UNAVAILABLE
naming the cause, health goes NOT_SERVING, the server stops and the process exits with status 1,
for the orchestrator to restart it.

The server binds its port, then builds the worker's parts once through `builder.build_worker`
(model -> adapters -> engine) with the bound port in its configuration (the worker id and the
address it advertises derive from it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve.inference_worker.adapters.preload import PreloadReport, preload
from loraserve.inference_worker.builder import build_worker
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.errors import DependencyUnavailable, WorkerError
from loraserve.inference_worker.metrics import WorkerMetrics
from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.output_delivery import dispatch_on
from loraserve.inference_worker.relay.core import RelayServer
from loraserve.inference_worker.relay.launch import FrontProcess
from loraserve.inference_worker.service import InferenceWorkerServicer
from loraserve.serving import tracing
from loraserve.serving.background import BackgroundServer
from loraserve.serving.gc_tuning import tune_gc
from loraserve.serving.interceptors import BearerTokenInterceptor, ErrorStatusInterceptor
from loraserve.serving.logs import configure_logging
from loraserve.serving.observed_calls import ObservedCallInterceptor
from loraserve.serving.ports import PortUnavailable, bind_grpc_port, grpc_server
from loraserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("loraserve.worker")
SERVICE_NAME = "loraserve.v1.InferenceWorker"
# the RPCs that need the generate token, and the admin token, when one is configured
GENERATE_METHODS = ("Generate", "GenerateStream")
ADMIN_METHODS = ("LoadAdapter", "UnloadAdapter", "PinAdapter")
FAILED_GRACE_S = 5.0  # after a failure, for the failed calls' statuses to reach their clients
FRONT_EXIT_S = 3.0  # how long a stopping worker lets its front finish its callers' calls
FRONT_CONNECT_S = 30.0  # from the relay socket's listening to the front's connecting


class WorkerServer:
    """A grpc.aio server with its engine, health, reflection, metrics and drain."""

    def __init__(self, config: WorkerConfig) -> None:
        self.health = health.aio.HealthServicer()
        if config.otlp_endpoint:
            tracing.enable_otlp(config.otlp_endpoint, "loraserve-worker")
        self.interceptors = [
            ObservedCallInterceptor(
                "worker", quiet={"GetWorkerInfo", "ListAdapters"}
            ),  # outermost: sees the status the caller gets
            BearerTokenInterceptor(
                {f"/{SERVICE_NAME}/{m}": config.generate_token for m in GENERATE_METHODS}
                | {f"/{SERVICE_NAME}/{m}": config.admin_token for m in ADMIN_METHODS}
            ),
            ErrorStatusInterceptor(log),
        ]
        self.grpc_server = grpc_server(
            self.interceptors,
            # 4 MiB bounds what a client can make the worker parse (a prompt is further bounded in
            # characters before it is tokenized)
            [("grpc.max_receive_message_length", 4 << 20)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (
                worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.grpc_server,
        )
        self.front: FrontProcess | None = None
        self.relay: RelayServer | None = None
        if config.stream_process:  # clients reach the front; this server listens on loopback only
            private = bind_grpc_port(self.grpc_server, "127.0.0.1", 0)
            self.front = FrontProcess(
                config.host,
                config.port,
                f"127.0.0.1:{private}",
                config.tls_cert,
                config.tls_key,
                count=config.stream_processes,
            )
            self.port = self.front.port
        else:
            self.port = bind_grpc_port(
                self.grpc_server, config.host, config.port, config.tls_cert, config.tls_key
            )
        # the bound port (port 0 picks one): the worker id and the advertised address derive from it
        self.config = config.replace(port=self.port) if config.port == 0 else config
        try:
            worker = build_worker(self.config)
        except BaseException:
            if self.front is not None:
                self.front.stop()
            raise
        self.engine, self.adapters, self.followers = worker.engine, worker.adapters, worker.followers
        self.failure: WorkerError | None = None  # why the worker stopped serving on its own
        self.stopped = asyncio.Event()
        self._grpc_started = False
        self._start_ended: asyncio.Event | None = None  # set once start() returned or raised
        self._stopping = False
        self._stopping_failed: asyncio.Future[None] | None = None
        # from the start's wait for the fronts until they have all connected: the first front's end
        self._front_exit: asyncio.Future[WorkerError] | None = None
        self.metrics = WorkerMetrics(self.engine, self.config.metrics_top_adapters)
        if self.adapters is not None:
            self.adapters.register_metrics(self.metrics.registry, self.metrics.per_adapter)
        self.servicer = InferenceWorkerServicer(self.engine, self.config, self.metrics, self.adapters)
        worker_pb2_grpc.add_InferenceWorkerServicer_to_server(self.servicer, self.grpc_server)
        if self.front is not None:
            self.relay = RelayServer(
                self.servicer,
                worker_pb2_grpc.add_InferenceWorkerServicer_to_server,
                self.interceptors,
                [f"/{SERVICE_NAME}/{m}" for m in GENERATE_METHODS],
                tokenizer_json=self.engine.tokenizer.to_str(),
                fronts=len(self.front.procs),
            )
        self.metrics_port: int | None = None
        self.preloaded: PreloadReport | None = None  # what --preload-adapters loaded

    async def start(self) -> None:
        """Start serving. A stop (or a failure) while it runs ends it at its next step with why
        (gRPC's server must not be stopped while it starts: `stop` waits for this to end)."""
        ended = self._start_ended = asyncio.Event()
        try:
            await self._start()
        finally:
            ended.set()

    def _stopped_while_starting(self) -> None:
        if self._stopping:
            raise self.failure or DependencyUnavailable("the worker was stopped while it started")

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.adapters is not None:
            # announced to the fleet (heartbeat, residency) only once it serves, below
            self.adapters.start(loop, on_fetched=self.engine.wake, sync=False)
            if self.config.preload_adapters.strip():
                # before the engine starts: a tensor-parallel runner copies the slots to its other
                # ranks before capturing its graphs, not at the first request (adapters/preload.py)
                self.preloaded = await preload(
                    self.adapters, self.config.preload_adapters, self.config.preload_timeout_s
                )
                self._stopped_while_starting()
        self.engine.output_dispatcher = dispatch_on(loop)
        if self.followers is not None:

            def on_failure(failure: WorkerError) -> None:  # on a watcher thread
                with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                    loop.call_soon_threadsafe(self.fail, failure)

            self.followers.on_failure(on_failure)
        self.engine.start()
        if self.front is not None and self.relay is not None:
            await self.relay.start(self.front.socket_path)
            self._stopped_while_starting()

            def on_front_exit(code: int) -> None:  # on a watcher thread
                with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                    loop.call_soon_threadsafe(self._front_exited, code)

            self.front.watch(on_front_exit)
            await self._await_fronts()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        # last: a caller that reaches the worker (directly, or through the front) finds it whole
        await self.grpc_server.start()
        self._grpc_started = True
        self._stopped_while_starting()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.adapters is not None:
            self.adapters.start_sync()
        log.info("worker %s listening on %s:%d", self.config.resolved_worker_id, self.config.host, self.port)

    async def drain(self, grace: float | None = None) -> None:
        """Refuse new work, give running generations `grace` seconds, then stop."""
        grace = self.config.grace_period_s if grace is None else grace
        self.servicer.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        end = time.monotonic() + grace
        await _wait_while(lambda: not self.engine.idle or bool(self.servicer.active), end)
        await self.stop(max(0.0, end - time.monotonic()))

    def fail(self, failure: WorkerError) -> None:
        """The worker can no longer compute: end every generation with `failure` at once, go
        NOT_SERVING and stop (`stopped` is then set and `failure` says why). On the event loop."""
        if self.failure is not None:
            return
        self.failure = failure
        self.servicer.draining = True
        ended = self.servicer.fail(failure)
        log.error("%s; the worker cannot compute: %d requests failed, stopping", failure, ended)
        self._stopping_failed = asyncio.ensure_future(self._stop_failed())

    async def _stop_failed(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.stop(FAILED_GRACE_S)  # the calls in flight have all been ended

    def _front_exited(self, code: int) -> None:
        """A front ended before `stop` (on the loop): before they have all connected, that fails the
        start (`_await_fronts`; the ends after the first are that failed start's too); after, the
        worker."""
        failure = DependencyUnavailable(f"the worker's front process exited ({code})")
        if self._front_exit is None:
            self.fail(failure)
        elif not self._front_exit.done():
            self._front_exit.set_result(failure)

    async def _await_fronts(self) -> None:
        """Until every front has connected to the relay; a front that ends first (or the time
        running out) fails the start with why."""
        assert self.relay is not None
        exited = self._front_exit = asyncio.get_running_loop().create_future()
        connected = asyncio.ensure_future(self.relay.connected.wait())
        try:
            await asyncio.wait(
                {exited, connected}, timeout=FRONT_CONNECT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            connected.cancel()
        if exited.done():
            raise exited.result()
        if not self.relay.connected.is_set():
            raise DependencyUnavailable(
                f"the worker's front processes did not connect within {FRONT_CONNECT_S:.0f} s"
            )
        self._front_exit = None  # from now on a front's end fails the worker

    async def stop(self, grace: float | None = 0.0) -> None:
        """Stop the server and the engine (once; a second call waits for the first)."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        if self._start_ended is not None and not self._start_ended.is_set():
            # a start under way ends at its next step (a wait for the fronts at once) before the
            # server is touched: grpc.aio crashes the process when a starting server is stopped
            if self._front_exit is not None and not self._front_exit.done():
                self._front_exit.set_result(
                    self.failure or DependencyUnavailable("the worker was stopped while it started")
                )
            await self._start_ended.wait()
        if self.front is not None:
            # what the generations in flight still send reaches their clients first: the calls
            # end, the relay hands the front their last frames and closes, the front finishes them
            end = time.monotonic() + (grace or 0.0)
            await _wait_while(lambda: bool(self.servicer.active), end)
            if self.relay is not None:
                await self.relay.close()
            await asyncio.to_thread(self.front.stop, FRONT_EXIT_S)
            if grace is not None:  # one grace for both: what is left of it
                grace = max(0.0, end - time.monotonic())
        if not self._grpc_started:
            # the start failed: gRPC listens on a port from when it is added and releases it only
            # when a started server stops, so the server starts, refusing work, and stops at once
            self.servicer.draining = True
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.grpc_server.start()
            grace = 0.0
        await self.grpc_server.stop(grace)
        await asyncio.to_thread(self.engine.shutdown)
        if self.adapters is not None:
            await self.adapters.close()
        self.metrics.close()
        self.stopped.set()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def _wait_while(busy: Callable[[], bool], end: float) -> None:
    """Until `busy()` is false or time.monotonic() reaches `end`."""
    while busy() and time.monotonic() < end:
        await asyncio.sleep(0.02)


def create_server(config: WorkerConfig) -> tuple[WorkerServer, int]:
    """Build the worker and its server (not started: `await server.start()`); port 0 picks one."""
    server = WorkerServer(config)
    return server, server.port


async def start_worker(config: WorkerConfig) -> tuple[WorkerServer, int]:
    """Create and start a worker in this event loop; `await server.drain()` or `.stop()` to end it."""
    server, port = create_server(config)
    try:
        await server.start()
    except BaseException:  # what it started stops: the engine's thread, the front, the fetches, hooks
        await server.stop()
        raise
    return server, port


class BackgroundWorker(BackgroundServer["WorkerServer"]):
    """A worker running on its own event loop in a daemon thread (embedded default, tests).

    bg = BackgroundWorker(WorkerConfig(model=..., port=0))
    ...  # talk to bg.address
    bg.stop()      # or bg.call(bg.server.drain(5.0))
    """

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(lambda: start_worker(config), config.host, "inference-worker")

    @property
    def engine(self) -> LLMEngine:
        assert self.server is not None
        return self.server.engine

    def stop(self, grace: float = 0.0) -> None:
        if self.server is not None:
            self._shutdown(self.server.stop(grace), join_s=30)


async def serve(config: WorkerConfig) -> int:
    """Serve until drained (SIGTERM, SIGINT: -> 0) or failed (-> 1)."""
    server, port = await start_worker(config)
    tune_gc(config.gc_threshold)  # process-wide: this process is the worker, now loaded
    # the bound ports, whatever the log level (--port 0 and --metrics-port 0 pick one)
    metrics = f" (metrics on {config.host}:{server.metrics_port})" if server.metrics_port is not None else ""
    print(f"worker {server.config.resolved_worker_id} listening on {config.host}:{port}{metrics}", flush=True)
    loop = asyncio.get_running_loop()

    async def on_signal() -> None:
        log.info("draining (grace %.1fs)", config.grace_period_s)
        await server.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(on_signal()))
    await server.stopped.wait()
    return 1 if server.failure is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    config = WorkerConfig.from_args(argv)
    configure_logging(config.log_level)
    sys.setswitchinterval(config.switch_interval_ms / 1e3)  # process-wide: this process is the worker
    try:
        return asyncio.run(serve(config))
    except ModelConfigError as exc:
        log.error("cannot start: %s", exc)
        return 2
    except PortUnavailable as exc:
        log.error("%s", exc)
        return 1
    except WorkerError as exc:  # a front that did not start, a rank that failed while it started
        log.error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
