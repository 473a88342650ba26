"""What the stream relay (`--stream-process`) adds to a worker's life: the front process and the
worker end together, whichever goes first, and a public port that is taken fails the start as the
worker's own would; a front that fails later (a joining one that cannot listen, one that ends or
stalls before it connects) fails it too and leaves nothing behind. (The service itself through the
relay: test_service.py runs every test both ways.)"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from loraserve.clients.worker_client import build_request
from loraserve.inference_worker.errors import DependencyUnavailable
from loraserve.serving.ports import PortUnavailable
from loraserve.v1 import worker_pb2_grpc
from tests.helpers.workers import stub_for, wait_for, worker_config


def test_a_dead_front_fails_the_worker(start_worker) -> None:
    bg = start_worker(stream_process=True)
    server = bg.server
    stub = stub_for(bg.address)
    stream = stub.GenerateStream(build_request("Hello", max_tokens=1000, ignore_eos=True), timeout=60)
    next(iter(stream))
    os.kill(server.front.proc.pid, signal.SIGKILL)
    assert wait_for(lambda: server.stopped.is_set())
    assert isinstance(server.failure, DependencyUnavailable) and "front process exited" in str(server.failure)
    assert wait_for(lambda: bg.engine.idle)  # the generation it was running was ended
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_the_front_ends_with_its_worker(tiny_model_dir) -> None:
    """However the worker ends (here: killed), its front process does not outlive it."""
    script = (
        "import sys, time\n"
        "from loraserve.inference_worker.server import BackgroundWorker\n"
        "from tests.helpers.workers import worker_config\n"
        f"bg = BackgroundWorker(worker_config({str(tiny_model_dir)!r}, stream_process=True))\n"
        "print(bg.server.front.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert worker.stdout is not None
        front = int(worker.stdout.readline())
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)

        def gone() -> bool:
            try:
                os.kill(front, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{front}/stat") as f:  # an exited child of init, not yet reaped
                return f.read().split()[2] == "Z"

        assert wait_for(gone)
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_taken_port_fails_the_start(tiny_model_dir) -> None:
    from loraserve.inference_worker.server import WorkerServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = worker_config(tiny_model_dir, port=taken.getsockname()[1], stream_process=True)

        async def create() -> None:  # as the worker's main does: on its event loop
            WorkerServer(config)

        with pytest.raises(PortUnavailable):
            asyncio.run(create())


def test_a_malformed_frame_closes_only_its_connection(start_worker) -> None:
    bg = start_worker(stream_process=True)
    with socket.socket(socket.AF_UNIX) as rogue:
        rogue.connect(bg.server.front.socket_path)
        rogue.sendall(b"\x00\x00\x00\x05hello")  # a frame whose body is not one
        rogue.settimeout(10)
        received = b""
        while chunk := rogue.recv(1 << 16):  # the worker's tokenizer (sent first), then the end
            received += chunk
        assert received[4:].find(b"tokenizer") >= 0  # closed by the worker after that one frame
    reply = stub_for(bg.address).Generate(build_request("Hello", max_tokens=3, ignore_eos=True), timeout=30)
    assert len(reply.token_ids) == 3


def test_health_watch_passes_through(start_worker) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    bg = start_worker(stream_process=True)
    watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(bg.address)).Watch(
        health_pb2.HealthCheckRequest(service="loraserve.v1.InferenceWorker"), timeout=10
    )
    assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_a_failing_worker_s_statuses_reach_every_caller_through_the_front(start_worker) -> None:
    """The worker fails while streams run: each caller gets the worker's own status and message
    through the front (the front finishes the calls it carries before it ends), not a closed
    socket or a cancellation."""
    bg = start_worker(stream_process=True, max_num_seqs=8)
    stub = stub_for(bg.address)
    streams = [
        stub.GenerateStream(build_request(f"Hello {i}", max_tokens=1000, ignore_eos=True), timeout=60)
        for i in range(8)
    ]
    for s in streams:
        next(iter(s))  # all eight are running
    failure = DependencyUnavailable("the accelerator went away (test)")

    async def fail() -> None:
        bg.server.fail(failure)

    bg.call(fail())
    for s in streams:
        with pytest.raises(grpc.RpcError) as err:
            list(s)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the accelerator went away (test)" in (err.value.details() or "")
    assert wait_for(lambda: bg.server.stopped.is_set())
    assert wait_for(lambda: bg.server.front.proc.poll() is not None)  # and then the front ended


def test_the_front_leaves_a_sigterm_to_its_worker(start_worker) -> None:
    """A SIGTERM to the whole process group reaches the front too: it ignores it (the worker
    drains, then ends the front through its pipe), so the worker is not failed by it."""
    bg = start_worker(stream_process=True)
    front = bg.server.front
    os.kill(front.proc.pid, signal.SIGTERM)
    os.kill(front.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert front.proc.poll() is None and bg.server.failure is None
    reply = stub_for(bg.address).Generate(build_request("Hello", max_tokens=3, ignore_eos=True), timeout=30)
    assert len(reply.token_ids) == 3
    started = time.monotonic()
    bg.stop()
    assert front.proc.poll() is not None and time.monotonic() - started < 10


def test_the_front_makes_the_text_of_plain_streams(start_worker) -> None:
    """A relayed stream without stop strings or logprobs is generated with tokens only and the
    front makes its text: the same text, per completion, as the worker makes for the same seeded
    request answered whole; a stream with stop strings or logprobs, and Generate, keep theirs."""
    bg = start_worker(stream_process=True)
    engine = bg.server.engine
    made: list[bool] = []
    build = engine.make_sequence

    def recording(*args, **kw):  # type: ignore[no-untyped-def]
        seq = build(*args, **kw)
        made.append(seq.params.detokenize)
        return seq

    engine.make_sequence = recording  # type: ignore[method-assign]
    stub = stub_for(bg.address)
    kw = dict(max_tokens=40, ignore_eos=True, temperature=1.0, seed=11, n=2)
    whole = stub.Generate(build_request("Once upon a time", **kw), timeout=30)
    streamed: dict[int, tuple[list[int], str, int]] = {}
    for msg in stub.GenerateStream(build_request("Once upon a time", **kw), timeout=30):
        ids, text, finish = streamed.get(msg.index, ([], "", 0))
        streamed[msg.index] = (ids + list(msg.token_ids), text + msg.text, msg.finish_reason or finish)
    assert len(whole.completions) == 2
    for c in whole.completions:
        assert streamed[c.index] == (list(c.token_ids), c.text, c.finish_reason)
        assert c.text  # a random model's 40 tokens decode to some text
    list(stub.GenerateStream(build_request("Hi", max_tokens=5, stop=["never said"]), timeout=30))
    list(stub.GenerateStream(build_request("Hi", max_tokens=5, logprobs=True), timeout=30))
    assert made == [True, False, True, True]


def test_a_worker_whose_start_fails_stops_what_it_started(tiny_model_dir, monkeypatch) -> None:
    """The metrics port is taken: the start fails after the engine's thread, the fronts and the
    collector timing hook were started, and none of them is left behind."""
    import gc
    import threading

    from loraserve.inference_worker.relay import launch
    from loraserve.inference_worker.server import start_worker

    fronts: list = []
    started = launch.FrontProcess.__init__

    def recorded(self, *args, **kw) -> None:
        fronts.append(self)
        started(self, *args, **kw)

    monkeypatch.setattr(launch.FrontProcess, "__init__", recorded)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = worker_config(
            tiny_model_dir, metrics_port=taken.getsockname()[1], stream_process=True, stream_processes=2
        )
        hooks = len(gc.callbacks)
        with pytest.raises(OSError):
            asyncio.run(start_worker(config))
    assert len(gc.callbacks) == hooks
    assert not [t for t in threading.enumerate() if t.name == "engine-step"]
    (front,) = fronts
    assert len(front.procs) == 2 and all(p.poll() is not None for p in front.procs)
    assert not os.path.exists(front.socket_path)


@pytest.mark.parametrize("killed", [0, 1], ids=["first", "joining"])
def test_several_fronts_share_the_port_and_each_ends_the_worker(start_worker, killed: int) -> None:
    bg = start_worker(stream_process=True, stream_processes=2)
    server = bg.server
    assert len(server.front.procs) == 2 and all(p.poll() is None for p in server.front.procs)
    assert wait_for(lambda: len(server.relay.calls_by_connection) == 2)  # both connected to the relay
    # clients on connections of their own: the kernel spreads them over the two fronts
    channels = [
        grpc.insecure_channel(bg.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(16)
    ]
    try:
        for channel in channels:
            stub = worker_pb2_grpc.InferenceWorkerStub(channel)
            got = list(stub.GenerateStream(build_request("Hello", max_tokens=3, ignore_eos=True), timeout=60))
            assert sum(len(m.token_ids) for m in got) == 3 and got[-1].finish_reason
    finally:
        for channel in channels:
            channel.close()
    calls = server.relay.calls_by_connection
    assert sum(calls) == 16 and min(calls) >= 1, calls  # (16 connections on one front: 2 ** -15)
    os.kill(server.front.procs[killed].pid, signal.SIGKILL)  # either front's end is the worker's
    assert wait_for(lambda: server.stopped.is_set())
    assert isinstance(server.failure, DependencyUnavailable) and "front process exited" in str(server.failure)
    assert wait_for(lambda: all(p.poll() is not None for p in server.front.procs))


def test_a_taken_port_fails_every_front_and_leaves_nothing(tiny_model_dir) -> None:
    from loraserve.inference_worker.relay.launch import FrontProcess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortUnavailable):
            FrontProcess("127.0.0.1", taken.getsockname()[1], "127.0.0.1:1", count=2)
    front = FrontProcess("127.0.0.1", 0, "127.0.0.1:1", count=3)  # port 0: the first picks, the rest join
    try:
        assert len(front.procs) == 3 and all(p.poll() is None for p in front.procs) and front.port > 0
    finally:
        front.stop()
    assert all(p.poll() is not None for p in front.procs) and not os.path.exists(front.socket_path)


def _free(port: int) -> bool:
    """Whether 127.0.0.1:port can be listened on (nothing holds it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past connections in TIME_WAIT)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _spawns(monkeypatch, joining_port: int | None = None) -> list:
    """(FrontProcess, its front's arguments) for each front spawned from now on; with
    `joining_port`, a joining front joins that port instead of the first front's, so that only it
    fails to listen when that one is taken."""
    from loraserve.inference_worker.relay import launch

    spawned: list = []
    spawn = launch.FrontProcess._spawn

    def recorded(self, args: list[str]):  # type: ignore[no-untyped-def]
        if joining_port is not None and "--joining" in args:
            i = args.index("--port") + 1
            args = [*args[:i], str(joining_port), *args[i + 1 :]]
        spawned.append((self, args))
        return spawn(self, args)

    monkeypatch.setattr(launch.FrontProcess, "_spawn", recorded)
    return spawned


def test_a_joining_front_that_cannot_listen_stops_every_front_and_leaves_nothing(monkeypatch) -> None:
    """The first front listens, then a joining one fails to (it is pointed at a taken port: nothing
    can take the first front's port from it): every front ends, the first's port is free again."""
    from loraserve.inference_worker.relay.launch import FrontProcess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spawned = _spawns(monkeypatch, joining_port=taken.getsockname()[1])
        with pytest.raises(PortUnavailable, match="cannot listen on 127.0.0.1"):
            FrontProcess("127.0.0.1", 0, "127.0.0.1:1", count=3)
    front = spawned[0][0]
    assert len(front.procs) == 3 and front.port > 0  # the first listened, then a joining one failed
    assert all(p.poll() is not None for p in front.procs) and not os.path.exists(front.socket_path)
    assert _free(front.port)


def _start_with(monkeypatch, signum: int, front: int, config) -> None:
    """start_worker(config), with the signal sent to one of the fronts between the worker's
    construction and its start (its fronts listen, none has connected to the relay yet)."""
    from loraserve.inference_worker import server as worker_server

    create = worker_server.create_server

    def created(config):  # type: ignore[no-untyped-def]
        server, port = create(config)
        os.kill(server.front.procs[front].pid, signum)
        return server, port

    monkeypatch.setattr(worker_server, "create_server", created)
    asyncio.run(worker_server.start_worker(config))


@pytest.mark.parametrize("ended", [0, 1], ids=["first", "joining"])
def test_a_front_that_ends_before_connecting_fails_the_start_and_leaves_nothing(
    tiny_model_dir, monkeypatch, ended: int
) -> None:
    """A front listens, then ends before it connects to the relay: the start fails at once with
    that front's exit, and the engine's thread, the fronts, the relay socket and both ports (the
    public one, and the worker's private one, which its gRPC server bound but never served) do not
    outlive it."""
    import threading

    spawned = _spawns(monkeypatch)
    config = worker_config(tiny_model_dir, stream_process=True, stream_processes=2)
    started = time.monotonic()
    with pytest.raises(DependencyUnavailable, match=r"front process exited \(-9\)"):
        _start_with(monkeypatch, signal.SIGKILL, ended, config)
    assert time.monotonic() - started < 20  # at once, not after the fronts' 30 s to connect
    front, args = spawned[0]
    private = int(args[args.index("--core") + 1].rsplit(":", 1)[1])
    assert not [t for t in threading.enumerate() if t.name == "engine-step"]
    assert all(p.poll() is not None for p in front.procs) and not os.path.exists(front.socket_path)
    assert _free(front.port) and _free(private)


def test_a_front_that_never_connects_fails_the_start_in_time(tiny_model_dir, monkeypatch) -> None:
    """A joining front listens, then stalls (stopped) before it connects: the start fails once the
    fronts' time to connect has run out, and the stalled front is ended too."""
    from loraserve.inference_worker import server as worker_server
    from loraserve.inference_worker.relay import launch

    monkeypatch.setattr(worker_server, "FRONT_CONNECT_S", 1.0)
    monkeypatch.setattr(launch, "STOP_WAIT_S", 0.5)  # (a stopped front is killed after it)
    spawned = _spawns(monkeypatch)
    config = worker_config(tiny_model_dir, stream_process=True, stream_processes=2)
    started = time.monotonic()
    with pytest.raises(DependencyUnavailable, match="did not connect within 1 s"):
        _start_with(monkeypatch, signal.SIGSTOP, 1, config)
    assert time.monotonic() - started < 20
    assert all(p.poll() is not None for p in spawned[0][0].procs)


@pytest.mark.parametrize(
    ("fronts", "when"), [(0, "engine"), (2, "engine"), (2, "fronts")], ids=["direct", "fronts", "waiting"]
)
def test_a_worker_that_fails_while_it_starts_stops_once_started(
    tiny_model_dir, monkeypatch, fronts: int, when: str
) -> None:
    """A failure reported while the worker starts (a tensor-parallel rank's watcher calls `fail`):
    as its engine starts, or while it waits for its fronts (one stalled). The start ends with that
    failure at once, the gRPC server is not stopped while it starts (grpc.aio ends the process
    then), and nothing outlives it: the engine's thread, the fronts, the port."""
    import threading

    from loraserve.inference_worker import server as worker_server

    monkeypatch.setattr(worker_server, "FRONT_CONNECT_S", 20.0)
    died = DependencyUnavailable("tensor-parallel rank 1 exited")
    config = worker_config(tiny_model_dir, stream_process=fronts > 0, stream_processes=max(1, fronts))

    async def go() -> worker_server.WorkerServer:
        server, _ = worker_server.create_server(config)
        loop = asyncio.get_running_loop()
        if when == "engine":
            start = server.engine.start

            def failing() -> None:
                start()
                server.fail(died)

            server.engine.start = failing  # type: ignore[method-assign]
        else:
            assert server.front is not None
            os.kill(server.front.procs[1].pid, signal.SIGSTOP)  # the joining front never connects
            loop.call_later(0.5, server.fail, died)
        began = time.monotonic()
        with pytest.raises(DependencyUnavailable, match="rank 1 exited"):
            await server.start()
        await server.stop()
        assert time.monotonic() - began < 10  # not the fronts' 20 s to connect
        assert server.stopped.is_set() and server.failure is died
        return server

    server = asyncio.run(go())
    assert not [t for t in threading.enumerate() if t.name == "engine-step"]
    ports = [server.port] + ([server.front.port] if server.front is not None else [])
    assert all(_free(p) for p in ports)
    if server.front is not None:
        assert all(p.poll() is not None for p in server.front.procs)
