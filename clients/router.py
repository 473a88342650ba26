"""Adapter-aware routing across inference workers.

A request goes to the worker that already holds its adapter, so a fleet of N workers serves far
more adapters than one worker's slots without thrashing them:

    1. workers holding the adapter in a GPU slot, least loaded first;
    2. workers holding it in the CPU cache, least loaded first;
    3. otherwise the adapter's home and then the rest in rendezvous order (`placement`): the home
       is the same worker that prefetches the adapter when it becomes popular, so repeated
       requests for an adapter held nowhere land on one worker and hit after the first.
    Bounded imbalance: a worker whose load is over `max(max_imbalance, least)` above the least
    loaded live worker's (`least`) loses its place and comes after every other worker, so a
    popular adapter's holder is not sent everything while it is overloaded (the next worker
    fetches a copy). Base requests go to the least loaded worker.

Residency and load come from each worker's ListAdapters and GetWorkerInfo, cached for `refresh_s`.
A routing decision never waits for them: a stale view is refreshed in the background (every
worker's at once, each call bounded by `refresh_timeout_s`) and requests are routed on the last
one meanwhile; only a router's first decision waits, at most `refresh_timeout_s`, for the first
views. A worker whose refresh times out or answers UNAVAILABLE is down for `down_s`.
Between refreshes the router keeps each worker's load current with its own traffic: a request it
sends counts on that worker until it ends (`routed`). Without that, every choice within a refresh
period saw the same numbers: under saturation a worker that read as overloaded lost every request
for its adapters to the other worker for up to `refresh_s` (whatever had happened since), which
then fetched copies of them. Measured through the services at saturation: two workers held ~100
of the most popular adapters twice and found 73–76 % of requests' adapters resident; with the
loads kept current, 8 twice and 89.6 % (H100, two workers, 1,000 adapters, Zipf 1.0).
A worker that answers UNAVAILABLE is skipped for `down_s` and the request is retried on the next
candidate (a stream only while it has produced nothing); a stream without a deadline whose first
message does not come within `first_message_timeout` is cancelled, its worker down too, and
DEADLINE_EXCEEDED raised. A worker that was down is routed to again once a refresh after `down_s`
finds it answering.

    router = WorkerRouter(["10.0.0.1:50061", "10.0.0.2:50061"])
    router = WorkerRouter(discover_workers("redis://redis:6379/0"))   # the fleet's live workers
    print(router.generate("Hello", adapter_id="support-bot", max_tokens=20).text)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from loraserve.clients.channel import KEEPALIVE, Keepalive
from loraserve.clients.placement import weight
from loraserve.clients.worker_client import FIRST_MESSAGE_TIMEOUT_S, FirstMessageTimeout, WorkerClient
from loraserve.clients.worker_messages import Delta, Generation
from loraserve.v1 import worker_pb2

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# a refresh that ends with one of these got no answer from the worker: it is down
_UNANSWERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class WorkerView:
    """What the router last saw of one worker."""

    address: str
    client: WorkerClient
    load: int = 0  # running + waiting sequences: as last reported, +/- this router's requests since
    gpu: set[str] = field(default_factory=set)  # adapter ids in GPU slots
    cpu: set[str] = field(default_factory=set)  # adapter ids in the CPU cache
    max_loras: int = 0  # GPU adapter slots
    seen_at: float = float("-inf")  # when its last refresh started (-inf: none has ended)
    down_until: float = float("-inf")  # no request and no refresh goes to it before then
    down: bool = False  # out of routing until a refresh started after it went down answers
    downs: int = 0  # times it went down (a refresh from before the last time cannot bring it back)
    refreshing: bool = False  # a refresh is in flight


def discover_workers(redis_url: str, prefix: str = "loraserve:", timeout_s: float = 2.0) -> list[str]:
    """Addresses of the workers whose heartbeat is alive in Redis. Workers keep the set
    `{prefix}workers` of their ids and, per id, `{prefix}worker:{id}` = JSON {"address", ...}
    with a TTL, so an expired key means a gone worker. `timeout_s` bounds the connection and each
    reply: a Redis that does not answer raises redis.TimeoutError."""
    import json

    import redis

    client = redis.Redis.from_url(
        redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, decode_responses=True
    )
    try:
        ids: list[str] = sorted(client.smembers(prefix + "workers"))  # type: ignore[arg-type]
        raws = client.mget([prefix + "worker:" + w for w in ids]) if ids else []
    finally:
        client.close()
    return [json.loads(raw)["address"] for raw in raws if raw is not None]


def _base_id(adapter_id: str) -> str:
    return adapter_id.split("@", 1)[0]


MAX_IMBALANCE = 16  # sequences over the least loaded worker before a holder loses its place
# WorkerRouter's defaults (the gateway's flags too): how old a view may be before it is refreshed, how
# long a refresh may take, how long a worker that did not answer is left out
REFRESH_S = 2.0
REFRESH_TIMEOUT_S = 2.0
DOWN_S = 5.0


def order_workers(
    adapter_id: str, live: Sequence[WorkerView], max_imbalance: int = MAX_IMBALANCE
) -> list[WorkerView]:
    """`live` in the order a request for `adapter_id` ("" = the base model) should try them."""
    if not live:
        return []
    least = min(w.load for w in live)
    aid = _base_id(adapter_id)

    def rank(w: WorkerView) -> tuple[int, int, int, int]:
        over = int(w.load - least > max(max_imbalance, least))
        if not aid:
            return (over, w.load, 0, 0)
        home_order = -weight(aid, w.address)
        if aid in w.gpu or aid in w.cpu:  # a holder, GPU first, the least loaded first
            return (over, 0 if aid in w.gpu else 1, w.load, home_order)
        return (over, 2, 0, home_order)  # held nowhere: the adapter's home, then rendezvous order

    return sorted(live, key=rank)


class WorkerRouter:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        refresh_s: float = REFRESH_S,
        refresh_timeout_s: float = REFRESH_TIMEOUT_S,
        down_s: float = DOWN_S,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout: float | None = None,
        first_message_timeout: float | None = FIRST_MESSAGE_TIMEOUT_S,
        keepalive: Keepalive | None = KEEPALIVE,
        tls: bool = False,
        clock: Callable[[], float] = time.monotonic,
        max_imbalance: int = MAX_IMBALANCE,
    ) -> None:
        if not addresses:
            raise ValueError("a router needs at least one worker address")
        self.refresh_s, self.refresh_timeout_s, self.down_s = refresh_s, refresh_timeout_s, down_s
        self._clock = clock
        self.max_imbalance = max_imbalance
        self._lock = threading.Lock()
        self._refreshed = threading.Condition(self._lock)  # notified as each refresh ends
        self.workers = [
            WorkerView(
                a,
                WorkerClient(
                    a,
                    token=token,
                    tls_ca=tls_ca,
                    timeout=timeout,
                    first_message_timeout=first_message_timeout,
                    keepalive=keepalive,
                    tls=tls,
                ),
            )
            for a in dict.fromkeys(addresses)
        ]

    def _refresh(self, w: WorkerView, started: float, downs: int) -> None:
        """Ask `w` for its view, both calls at once, and return: `_refreshed_view` takes the answers
        (on a gRPC thread). `downs`: w.downs when the refresh was decided on."""
        try:
            info = w.client.stub.GetWorkerInfo.future(
                worker_pb2.GetWorkerInfoRequest(), timeout=self.refresh_timeout_s
            )
            listed = w.client.stub.ListAdapters.future(
                worker_pb2.ListWorkerAdaptersRequest(), timeout=self.refresh_timeout_s
            )
        except BaseException:  # (a closed channel)
            with self._lock:
                w.refreshing = False
            raise
        taken = False

        def done(_: object) -> None:
            nonlocal taken
            with self._lock:
                if taken or not (info.done() and listed.done()):
                    return
                taken = True
                self._refreshed_view(w, started, downs, info, listed)
                self._refreshed.notify_all()

        info.add_done_callback(done)
        listed.add_done_callback(done)

    def _refreshed_view(
        self,
        w: WorkerView,
        started: float,
        downs: int,
        info: grpc.Future,
        listed: grpc.Future,
    ) -> None:
        """The answers of the refresh of `w` that started at `started` (under the lock)."""
        w.refreshing, w.seen_at = False, started
        try:
            got_info, got_listed = info.result(), listed.result()
        except grpc.FutureCancelledError:
            return
        except grpc.RpcError as exc:
            code = exc.code()
            if code in _UNANSWERED:
                self._went_down(w)
            elif code != grpc.StatusCode.CANCELLED and w.downs == downs:  # it answered, if with an error
                w.down = False
            return
        w.load = got_info.num_running + got_info.num_waiting
        w.max_loras = got_info.max_loras
        adapters = got_listed.adapters
        w.gpu = {a.adapter_id for a in adapters if a.tier == worker_pb2.ADAPTER_TIER_GPU}
        w.cpu = {a.adapter_id for a in adapters if a.tier == worker_pb2.ADAPTER_TIER_CPU}
        if w.downs == downs:
            w.down = False

    def _went_down(self, w: WorkerView) -> None:
        w.down_until, w.down = self._clock() + self.down_s, True
        w.downs += 1

    def candidates(self, adapter_id: str = "") -> list[WorkerView]:
        """Live workers in the order this request should try them."""
        now = self._clock()
        with self._lock:
            due = [
                (w, w.downs)
                for w in self.workers
                if not w.refreshing and now >= w.down_until and (w.down or now - w.seen_at >= self.refresh_s)
            ]
            for w, _ in due:
                w.refreshing = True
        for w, downs in due:
            self._refresh(w, now, downs)
        with self._lock:
            # the first decision waits for the first views: each refresh ends by its deadline (the
            # second is a margin for gRPC to report it)
            self._refreshed.wait_for(
                lambda: not any(w.refreshing and w.seen_at == float("-inf") for w in self.workers),
                timeout=self.refresh_timeout_s + 1.0,
            )
            now = self._clock()
            live = [w for w in self.workers if now >= w.down_until and not w.down] or list(self.workers)
        return order_workers(adapter_id, live, self.max_imbalance)

    def pick(self, adapter_id: str = "") -> str:
        return self.candidates(adapter_id)[0].address

    def mark_down(self, w: WorkerView) -> None:
        with self._lock:
            self._went_down(w)

    @contextmanager
    def routed(self, w: WorkerView) -> Iterator[None]:
        """A request sent to `w` through this router: it counts in `w`'s load until it ends. The
        worker's next report includes it while it runs, so its end takes it off that report too."""
        with self._lock:
            w.load += 1
        try:
            yield
        finally:
            with self._lock:
                w.load = max(0, w.load - 1)

    def note_use(self, w: WorkerView, adapter_id: str) -> None:
        aid = _base_id(adapter_id)
        if aid:
            with self._lock:
                w.gpu.add(aid)

    def generate(
        self, prompt: str | Sequence[int] | None = None, *, adapter_id: str = "", **kw
    ) -> Generation:
        last: grpc.RpcError | None = None
        for w in self.candidates(adapter_id):
            try:
                with self.routed(w):
                    out = w.client.generate(prompt, adapter_id=adapter_id, **kw)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                self.mark_down(w)
                last = exc
                continue
            self.note_use(w, adapter_id)
            return out
        assert last is not None
        raise last

    def generate_stream(
        self, prompt: str | Sequence[int] | None = None, *, adapter_id: str = "", **kw
    ) -> Iterator[Delta]:
        last: grpc.RpcError | None = None
        for w in self.candidates(adapter_id):
            started = False
            try:
                with self.routed(w):
                    for delta in w.client.generate_stream(prompt, adapter_id=adapter_id, **kw):
                        started = True
                        yield delta
            except grpc.RpcError as exc:
                if isinstance(exc, FirstMessageTimeout):  # hung, or queueing that long: not now
                    self.mark_down(w)
                    raise
                if started or exc.code() not in _RETRYABLE:
                    raise
                self.mark_down(w)
                last = exc
                continue
            self.note_use(w, adapter_id)
            return
        assert last is not None
        raise last

    def close(self) -> None:
        for w in self.workers:
            w.client.close()

    def __enter__(self) -> WorkerRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
