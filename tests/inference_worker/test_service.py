"""The InferenceWorker service through real grpc.aio servers on port 0 and the generated stubs;
every test twice: clients talking to the worker's own server, and to its front process
(`--stream-process`: generations relayed over a local socket, other calls passed through)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loraserve.clients.worker_cli import generate_main
from loraserve.clients.worker_client import AsyncWorkerClient, WorkerClient, build_request
from loraserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.tls import self_signed_cert
from tests.helpers.workers import stream_sizes, stub_for, wait_for, worker_config

PROMPTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Once",
    "0123456789 + - * /",
    "Each worker keeps the most recently used adapters in GPU slots and the rest in a CPU cache.",
    "loraserve serves many low-rank adapters",
    "Every request in a batch may use its own adapter;",
    "The adapter store fetches checkpoints,",
]


@pytest.fixture(scope="module", params=["direct", "relay"])
def worker(tiny_model_dir, request):
    from loraserve.inference_worker.server import BackgroundWorker

    bg = BackgroundWorker(worker_config(tiny_model_dir, stream_process=request.param == "relay"))
    yield bg
    bg.stop()


@pytest.fixture(params=["direct", "relay"])
def start_worker(start_worker, request):
    return functools.partial(start_worker, stream_process=request.param == "relay")


def test_generate_and_stream_agree(worker) -> None:
    with WorkerClient(worker.address) as w:
        full = w.generate("Hello world.", max_tokens=20, ignore_eos=True)
        deltas = list(w.generate_stream("Hello world.", max_tokens=20, ignore_eos=True))
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    u = deltas[-1].usage
    assert u.prompt_tokens == full.usage.prompt_tokens > 0 and u.completion_tokens == 20
    assert 0 <= u.queue_time_ms <= u.time_to_first_token_ms <= u.total_time_ms


def _by_index(messages) -> dict[int, list[worker_pb2.GenerateStreamResponse]]:
    out: dict[int, list[worker_pb2.GenerateStreamResponse]] = {}
    for m in messages:
        out.setdefault(m.index, []).append(m)
    return out


@contextlib.contextmanager
def held_after_its_first_outputs(engine, request_id: str) -> Iterator[threading.Event]:
    """The engine's step thread, once it has handed over `request_id`'s first outputs, waits until
    the event yielded is set (the client has its first messages): outputs that queue while the
    event loop or the front is busy leave as one message, and a busy machine must not merge the
    first ones with what follows."""
    read = threading.Event()
    dispatch = engine.output_dispatcher

    def held(items) -> None:
        dispatch(items)
        if not read.is_set() and any(out.request_id == request_id for _, out in items):
            read.wait(30)

    engine.output_dispatcher = held
    try:
        yield read
    finally:
        read.set()
        engine.output_dispatcher = dispatch


@pytest.mark.parametrize("every", [4, 16])
def test_a_stream_interval_sends_the_same_completions_in_fewer_messages(worker, every: int) -> None:
    """GenerateRequest.stream_interval k: the engine emits each completion's tokens [1, k, ..., k,
    rest] (the first alone and at once, what is left with the finish reason; the usage on the
    very last), with the tokens, text, logprobs and finish reasons of a stream of one token a
    message: plain (the relay's front makes its text), n = 2 with logprobs, and cut by a stop
    string. Outputs that queued together (a step's running output and its ending; a loop that fell
    behind) leave as one message, so a message ends where an output ended. Generate answers the
    same whole."""
    stub = stub_for(worker.address)
    plain = build_request(PROMPTS[1], max_tokens=21, ignore_eos=True)
    text = stub.Generate(plain, timeout=30).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [
        dict(max_tokens=21, ignore_eos=True),
        dict(max_tokens=13, ignore_eos=True, temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=2),
        dict(max_tokens=21, ignore_eos=True, stop=[stop]),
    ]
    for kw in cases:
        one = list(stub.GenerateStream(build_request(PROMPTS[1], **kw), timeout=30))
        grouped: list[worker_pb2.GenerateStreamResponse] = []
        with held_after_its_first_outputs(worker.engine, "grouped") as first_read:
            request = build_request(PROMPTS[1], stream_interval=every, request_id="grouped", **kw)
            for m in stub.GenerateStream(request, timeout=30):
                grouped.append(m)
                if len({g.index for g in grouped}) == kw.get("n", 1):
                    first_read.set()
        want, got = _by_index(one), _by_index(grouped)
        assert sorted(got) == sorted(want) == list(range(kw.get("n", 1)))
        for index, mine in got.items():
            ids = [t for m in mine for t in m.token_ids]
            assert ids == [t for m in want[index] for t in m.token_ids]
            sizes = [len(m.token_ids) for m in mine]
            assert sizes[0] == 1  # the first token at once, alone
            assert set(itertools.accumulate(sizes)) <= set(
                itertools.accumulate(stream_sizes(len(ids), every))
            )
            assert "".join(m.text for m in mine) == "".join(m.text for m in want[index])
            assert [lp.token_id for m in mine for lp in m.logprobs] == (ids if kw.get("logprobs") else [])
            assert [len(lp.top_logprobs) for m in mine for lp in m.logprobs] == [
                len(lp.top_logprobs) for m in want[index] for lp in m.logprobs
            ]
            assert [m.finish_reason for m in mine if m.finish_reason] == [want[index][-1].finish_reason]
            assert mine[-1].finish_reason != 0
        assert [m.HasField("usage") for m in grouped] == [False] * (len(grouped) - 1) + [True]
        assert grouped[-1].usage.completion_tokens == one[-1].usage.completion_tokens
    assert want[0][-1].finish_reason == worker_pb2.FINISH_REASON_STOP  # the stop string's case
    whole = stub.Generate(build_request(PROMPTS[1], stream_interval=every, **cases[1]), timeout=30)
    assert [list(c.token_ids) for c in whole.completions] == [
        list(c.token_ids)
        for c in stub.Generate(build_request(PROMPTS[1], **cases[1]), timeout=30).completions
    ]


@pytest.mark.parametrize("every", [-1, 1025])
def test_a_stream_interval_out_of_range_is_invalid_argument(worker, every: int) -> None:
    stub = stub_for(worker.address)
    request = build_request(PROMPTS[0], max_tokens=4, stream_interval=every)
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"stream_interval must be in [0, 1024] (0 = the worker's default), got {every}" in (
            err.value.details()
        )


def test_concurrent_streams_match_alone(worker) -> None:
    requests = [build_request(p, max_tokens=8 + 5 * i, ignore_eos=True) for i, p in enumerate(PROMPTS * 2)]
    stub = stub_for(worker.address)
    alone = [list(stub.Generate(r, timeout=30).token_ids) for r in requests]

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            s = worker_pb2_grpc.InferenceWorkerStub(ch)

            async def one(r) -> list[int]:
                return [t async for m in s.GenerateStream(r, timeout=60) for t in m.token_ids]

            return list(await asyncio.gather(*(one(r) for r in requests)))

    together = asyncio.run(run())
    assert together == alone
    assert wait_for(lambda: worker.engine.idle)


def test_seeded_sampling_over_grpc(worker) -> None:
    with WorkerClient(worker.address) as w:
        kw = dict(max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
        a, b = w.generate(PROMPTS[1], **kw), w.generate(PROMPTS[1], **kw)
        c = w.generate(PROMPTS[1], **{**kw, "seed": 8})
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_prompt_token_ids_and_stop_strings(worker) -> None:
    with WorkerClient(worker.address) as w:
        full = w.generate(PROMPTS[0], max_tokens=30, ignore_eos=True)
        ids = w.generate([int(t) for t in stub_tokens(worker, PROMPTS[0])], max_tokens=30, ignore_eos=True)
        assert ids.token_ids == full.token_ids
        stop = full.text[5:9]
        assert len(stop) == 4
        cut = w.generate(PROMPTS[0], max_tokens=30, ignore_eos=True, stop=[stop])
        streamed = "".join(
            d.text for d in w.generate_stream(PROMPTS[0], max_tokens=30, ignore_eos=True, stop=[stop])
        )
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)] == streamed


def stub_tokens(worker, text: str) -> list[int]:
    return worker.engine.tokenizer.encode(text).ids


@pytest.mark.parametrize(
    "sampling, message",
    [
        (worker_pb2.SamplingParams(temperature=-1.0), "temperature"),
        (worker_pb2.SamplingParams(temperature=float("inf")), "temperature"),
        (worker_pb2.SamplingParams(temperature=float("nan")), "temperature"),
        (worker_pb2.SamplingParams(top_p=1.5), "top_p"),
        (worker_pb2.SamplingParams(top_k=-2), "top_k"),
        (worker_pb2.SamplingParams(max_tokens=-3), "max_tokens"),
    ],
)
def test_bad_sampling_values(worker, sampling, message) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub_for(worker.address).Generate(
            worker_pb2.GenerateRequest(prompt="hi", sampling=sampling), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_over_long_prompt_and_empty_prompt(worker) -> None:
    stub = stub_for(worker.address)
    max_len = worker.engine.config.max_model_len
    for req in (
        worker_pb2.GenerateRequest(prompt_token_ids=[5] * max_len),
        worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(max_tokens=max_len)),
        worker_pb2.GenerateRequest(prompt=""),
        worker_pb2.GenerateRequest(prompt_token_ids=[1, 99999]),
    ):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GenerateStream(req, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Generate(worker_pb2.GenerateRequest(prompt="still serving"), timeout=10).token_ids


def test_cancel_mid_stream_frees_blocks(worker) -> None:
    engine = worker.engine
    start = engine.num_free_blocks
    stub = stub_for(worker.address)
    call = stub.GenerateStream(build_request(PROMPTS[4], max_tokens=1000, ignore_eos=True), timeout=60)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            break
    assert engine.num_running == 1 and engine.num_free_blocks < start
    call.cancel()
    assert wait_for(lambda: engine.num_free_blocks == start and engine.idle)


def test_deadline_expiry_frees_blocks(worker) -> None:
    engine = worker.engine
    start = engine.num_free_blocks
    with pytest.raises(grpc.RpcError) as err:
        stub_for(worker.address).Generate(
            build_request(PROMPTS[4], max_tokens=1000, ignore_eos=True), timeout=0.3
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: engine.num_free_blocks == start and engine.idle)


def test_queue_full(start_worker) -> None:
    bg = start_worker(max_num_seqs=1, max_num_batched_tokens=16, max_queue_size=1)
    stub = stub_for(bg.address)
    first = stub.GenerateStream(build_request(PROMPTS[0], max_tokens=1000, ignore_eos=True), timeout=60)
    next(iter(first))  # running now
    second = stub.Generate.future(build_request(PROMPTS[1], max_tokens=4), timeout=60)
    assert wait_for(lambda: bg.engine.num_waiting == 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(build_request(PROMPTS[2], max_tokens=4), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.cancel()
    assert len(second.result().token_ids) > 0


def test_adapters_without_store(worker) -> None:
    stub = stub_for(worker.address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(worker_pb2.GenerateRequest(prompt="hi", adapter_id="my-adapter"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no adapter store configured" in err.value.details()
    for call, req in (
        (stub.LoadAdapter, worker_pb2.LoadAdapterRequest(adapter_id="a")),
        (stub.UnloadAdapter, worker_pb2.UnloadAdapterRequest(adapter_id="a")),
        (stub.PinAdapter, worker_pb2.PinAdapterRequest(adapter_id="a", pinned=True)),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert list(stub.ListAdapters(worker_pb2.ListWorkerAdaptersRequest(), timeout=10).adapters) == []


def test_worker_info_health_reflection(worker) -> None:
    info = stub_for(worker.address).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)
    assert info.model == "tiny-llama" and info.device == "cpu" and info.dtype == "float32"
    assert (
        info.max_num_seqs == 8 and info.num_kv_blocks == 128 and info.block_size == 16 and info.vocab_size > 0
    )
    ch = grpc.insecure_channel(worker.address)
    health = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service="loraserve.v1.InferenceWorker"), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    [resp] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "loraserve.v1.InferenceWorker" in {s.name for s in resp.list_services_response.service}


def test_drain(start_worker) -> None:
    bg = start_worker(grace_period_s=20.0)
    stub = stub_for(bg.address)
    running = stub.GenerateStream(build_request(PROMPTS[1], max_tokens=150, ignore_eos=True), timeout=60)
    it = iter(running)
    first = next(it)
    drained = threading.Event()
    threading.Thread(target=lambda: (bg.call(bg.server.drain()), drained.set()), daemon=True).start()
    assert wait_for(lambda: bg.server.servicer.draining)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(bg.address)).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(build_request("new work", max_tokens=4), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(it)
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 150
    assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert drained.wait(20)


def test_tokens_and_metrics(start_worker, capsys) -> None:
    # metrics on port 0: a port picked beforehand may be taken by then (the relay's front and the
    # worker's loopback server bind ports of their own in between)
    bg = start_worker(generate_token="gen-secret", admin_token="admin-secret", metrics_port=0)
    stub = stub_for(bg.address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(build_request("hi", max_tokens=2), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            build_request("hi", max_tokens=2), timeout=10, metadata=[("authorization", "Bearer nope")]
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with WorkerClient(bg.address, token="gen-secret", admin_token="admin-secret") as w:
        assert len(w.generate("hi", max_tokens=3, ignore_eos=True).token_ids) == 3
        with pytest.raises(grpc.RpcError) as err:
            w.load_adapter("a")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # authorized, but no store
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadAdapter(
            worker_pb2.LoadAdapterRequest(adapter_id="a"),
            timeout=10,
            metadata=[("authorization", "Bearer gen-secret")],
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{bg.server.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert 'loraserve_worker_requests_total{code="OK",method="Generate"} 1.0' in body
    assert "loraserve_worker_generated_tokens_total 3.0" in body
    assert "loraserve_worker_queue_depth" in body and "loraserve_worker_time_to_first_token_seconds" in body
    # one generation of 3 tokens: a prefill step, then 2 decode steps, each with one sequence
    assert 'loraserve_worker_step_seconds_count{kind="prefill"} 1.0' in body
    assert 'loraserve_worker_step_seconds_count{kind="decode"} 2.0' in body
    assert "loraserve_worker_step_sequences_sum 3.0" in body
    assert "loraserve_worker_step_adapters_sum 0.0" in body  # the base model's rows: no adapter
    # on a CPU no step waits for a device, and none is timed on one
    assert "loraserve_worker_device_wait_seconds_total 0.0" in body
    assert "loraserve_worker_step_device_seconds_count 0.0" in body
    # the CLI streams to the terminal
    assert generate_main(["--worker", bg.address, "--token", "gen-secret", "--max-tokens", "5", "Hello"]) == 0
    assert capsys.readouterr().out.strip()
    assert generate_main(["--worker", bg.address, "Hello"]) == 1
    # --stream-interval: the same text (the messages are counted through the clients' tests), a
    # value out of range refused by the CLI itself
    capsys.readouterr()
    common = ["--worker", bg.address, "--token", "gen-secret", "--max-tokens", "9", "--ignore-eos"]
    assert generate_main([*common, "Hello"]) == 0
    per_token = capsys.readouterr().out
    assert generate_main([*common, "--stream-interval", "4", "Hello"]) == 0
    assert capsys.readouterr().out == per_token
    for bad in ("-4", "3000000000"):
        with pytest.raises(SystemExit) as usage:
            generate_main([*common, "--stream-interval", bad, "Hello"])
        assert usage.value.code == 2 and "need 0 <= K <= 1024" in capsys.readouterr().err


def test_async_client(worker) -> None:
    async def run():
        async with AsyncWorkerClient(worker.address) as w:
            g = await w.generate(PROMPTS[0], max_tokens=6, ignore_eos=True)
            d = [x async for x in w.generate_stream(PROMPTS[0], max_tokens=6, ignore_eos=True)]
            info = await w.info()
            return g, d, info

    g, d, info = asyncio.run(run())
    assert [t for x in d for t in x.token_ids] == g.token_ids and info.max_model_len > 0


def test_tls(start_worker, tmp_path) -> None:
    pytest.importorskip("cryptography")
    cert, key = self_signed_cert(tmp_path)
    bg = start_worker(tls_cert=cert, tls_key=key)
    with WorkerClient(bg.address, tls_ca=cert, timeout=10) as w:
        assert len(w.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3
    with pytest.raises(grpc.RpcError):  # plaintext against a TLS port
        stub_for(bg.address).Generate(build_request("Hello", max_tokens=3), timeout=3)


def test_build_request_carries_chat_and_sampling_fields() -> None:
    req = build_request(
        messages=[{"role": "system", "content": "Be brief."}, ("user", "Hi")],
        add_generation_prompt=False,
        n=3,
        seed=7,
        logprobs=True,
        top_logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
    )
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert req.HasField("add_generation_prompt") and not req.add_generation_prompt
    assert not req.prompt and not req.prompt_token_ids
    s = req.sampling
    assert (s.n, s.seed, s.logprobs, s.top_logprobs) == (3, 7, True, 5)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.25)
    assert s.repetition_penalty == pytest.approx(1.3)
    assert not build_request("hi").HasField("add_generation_prompt")
    assert build_request("hi").stream_interval == 0
    assert build_request("hi", stream_interval=16).stream_interval == 16


def test_response_repeats_first_completion(worker) -> None:
    with WorkerClient(worker.address) as w:
        out = w.generate("Hello world.", max_tokens=6, ignore_eos=True)
    assert len(out.completions) == 1
    c = out.completions[0]
    assert (c.index, c.text, c.token_ids, c.finish_reason) == (0, out.text, out.token_ids, out.finish_reason)
