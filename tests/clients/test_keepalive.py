"""The worker clients' HTTP/2 keepalive against real servers on port 0 made by the services' own
`grpc_server`: the servers accept the pings of an idle connection and of a stream waiting for its
first message (gRPC's defaults answer the third with GOAWAY, too_many_pings, failing the stream),
and a peer that goes silent with its connection open ends a stream in mid-generation."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from loraserve.clients.channel import KEEPALIVE, MIN_KEEPALIVE_S, Keepalive
from loraserve.clients.worker_client import WorkerClient
from loraserve.serving.ports import KEEPALIVE_POLICY, MIN_PING_INTERVAL_S
from tests.helpers.fake_workers import FakeWorker, FreezingProxy, fake_workers

pytestmark = pytest.mark.timeout(60)
QUICK = Keepalive(interval_s=MIN_KEEPALIVE_S, timeout_s=1.0)  # a ping every 2 s: the fastest allowed


@pytest.mark.slow
def test_servers_accept_the_pings_of_an_idle_connection_and_of_a_silent_stream() -> None:
    """Over 7 s of silence each connection sends 3 pings: one waits for a stream's first message, the
    other has no call at all (gRPC's defaults close it at the third), then makes one. Neither
    connection is closed."""
    worker = FakeWorker()
    worker.first_message_s, worker.stream_messages = 7.0, 1
    with fake_workers(worker) as (address,):
        streaming = WorkerClient(address, keepalive=QUICK, first_message_timeout=None, own_connection=True)
        idle = WorkerClient(address, keepalive=QUICK, own_connection=True)
        states: list[grpc.ChannelConnectivity] = []
        try:
            idle.info()
            idle.channel.subscribe(states.append)
            got: list = []
            stream = threading.Thread(target=lambda: got.append(list(streaming.generate_stream([1]))))
            stream.start()
            stream.join(15.0)
            assert len(got) == 1 and [d.token_ids for d in got[0]] == [[0]]  # not UNAVAILABLE
            assert idle.info().max_loras == 4
            assert set(states) == {grpc.ChannelConnectivity.READY}, states  # never closed, never reopened
        finally:
            idle.channel.unsubscribe(states.append)
            streaming.close()
            idle.close()


def test_a_peer_gone_silent_ends_a_stream_in_mid_generation() -> None:
    """The stream has started (no first-message deadline left) and has no deadline; its peer stops
    answering with the connection open: the unanswered ping closes it within interval + timeout."""
    worker = FakeWorker()
    worker.stream_gap_s, worker.stream_messages = 0.1, 600  # a minute of generation
    with fake_workers(worker) as (address,):
        proxy = FreezingProxy(address)
        try:
            with WorkerClient(proxy.address, keepalive=QUICK) as client:
                deltas = client.generate_stream([1])
                assert next(deltas).token_ids == [0]
                proxy.frozen.set()
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    for _ in deltas:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - t0 < QUICK.interval_s + QUICK.timeout_s + 2.0
        finally:
            proxy.close()


def test_the_clients_ping_no_faster_than_the_servers_accept() -> None:
    policy = dict(KEEPALIVE_POLICY)
    assert policy["grpc.keepalive_permit_without_calls"] == 1  # an idle connection's pings too
    # twice the servers' floor: a ping sent early by timer jitter is never a strike
    assert policy["grpc.http2.min_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_S * 1000
    assert MIN_KEEPALIVE_S >= 2 * MIN_PING_INTERVAL_S and KEEPALIVE.interval_s >= MIN_KEEPALIVE_S
    with pytest.raises(ValueError, match="keepalive interval must be >= 2"):
        Keepalive(interval_s=1.0)
    options = dict(KEEPALIVE.options())
    assert options["grpc.keepalive_time_ms"] == 30_000 and options["grpc.http2.max_pings_without_data"] == 0
