"""Seeded random GenerateRequests (odd prompts, chat messages, token ids, sampling values, n,
logprobs, penalties, stop strings, adapter ids) against a real worker, many at once: each call ends OK or with a status the client can act
on (never INTERNAL/UNKNOWN), and afterwards the worker is healthy with all KV blocks free."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.workers import stub_for

CASES = 160
# each field is usually valid, sometimes odd, so that most requests run and the odd ones meet
# a scheduler busy with the others
_VALID = {
    "max_tokens": [0, 1, 3, 8],
    "temperature": [0.0, 0.5, 1.0, 1.7],
    "top_k": [0, 1, 5, 40],
    "top_p": [0.0, 0.3, 0.9, 1.0],
    "text": ["hello", "Once upon a time", "日本語のテキスト", " ", "\ufffd"],
    "token": [5, 17, 400],
    "adapter": [""],
    "stop": ["o", " the", "🙂", "ab"],
    "stop_id": [5, 17, 2],
    "n": [0, 1, 2, 3],
    "top_logprobs": [0, 0, 2, 20],
    "penalty": [0.0, 0.0, 0.5, -1.0, 2.0],
    "repetition": [0.0, 1.0, 1.3, 0.8],
    "role": ["user", "user", "system", "assistant"],
}
_ODD = {
    "max_tokens": [-1, 10**6],
    "temperature": [-0.1, -1e30, 1e30, float("nan"), float("inf"), 1e-45],
    "top_k": [-1, -(2**31), 2**31 - 1],
    "top_p": [-0.1, 1.5, float("nan"), float("inf"), 1e-45],
    "text": ["", "\x00\x01", "🙂" * 20, "a" * 3000],
    "token": [-3, 10**6, 2**31 - 1],
    "adapter": ["../x", "a" * 200, "no-such@" + "0" * 64, "bad@digest"],
    "stop": ["", "a" * 500],
    "stop_id": [-1, 2**31 - 1],
    "n": [-1, 9, 2**31 - 1],
    "top_logprobs": [-1, 21, 2**31 - 1],
    "penalty": [2.5, float("nan"), float("inf"), -1e30],
    "repetition": [-1.0, float("nan"), float("inf"), 1e-45],
    "role": ["robot", "", "tool"],
}


def _pick(rng: random.Random, field: str, odd: float = 0.12):
    return rng.choice(_ODD[field] if rng.random() < odd else _VALID[field])


def _request(rng: random.Random):
    from loraserve.v1 import worker_pb2

    sampling = worker_pb2.SamplingParams(
        max_tokens=_pick(rng, "max_tokens"),
        temperature=_pick(rng, "temperature"),
        top_k=_pick(rng, "top_k"),
        top_p=_pick(rng, "top_p"),
        stop=[_pick(rng, "stop") for _ in range(rng.randint(0, 2))],
        stop_token_ids=[_pick(rng, "stop_id") for _ in range(rng.randint(0, 2))],
        ignore_eos=rng.random() < 0.3,
        n=_pick(rng, "n", 0.04),
        presence_penalty=_pick(rng, "penalty", 0.04),
        frequency_penalty=_pick(rng, "penalty", 0.04),
        repetition_penalty=_pick(rng, "repetition", 0.04),
    )
    if rng.random() < 0.3:
        sampling.logprobs = True
        sampling.top_logprobs = _pick(rng, "top_logprobs", 0.1)
    if rng.random() < 0.5:
        sampling.seed = rng.choice([0, 1, 2**64 - 1])
    req = worker_pb2.GenerateRequest(
        sampling=sampling, request_id=rng.choice(["", "", "x" * 256]), adapter_id=_pick(rng, "adapter")
    )
    kind = rng.random()
    if kind < 0.4:
        req.prompt = _pick(rng, "text")
    elif kind < 0.75:
        req.prompt_token_ids.extend(_pick(rng, "token") for _ in range(rng.randint(0, 12)))
    if kind >= 0.7:  # chat (sometimes with a prompt too, which is refused)
        for _ in range(rng.randint(0, 3)):
            req.messages.add(role=_pick(rng, "role", 0.1), content=_pick(rng, "text"))
        if rng.random() < 0.5:
            req.add_generation_prompt = rng.random() < 0.7
    return req


@pytest.mark.slow
def test_random_requests_never_break_the_worker(start_worker) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    bg = start_worker(max_queue_size=256)
    stub = stub_for(bg.address)
    rng = random.Random(2026)
    requests = [_request(rng) for _ in range(CASES)]
    bad = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

    def call(i: int) -> str:
        try:
            if i % 2:
                stub.Generate(requests[i], timeout=60)
            else:
                for _ in stub.GenerateStream(requests[i], timeout=60):
                    pass
            return "OK"
        except grpc.RpcError as exc:
            assert exc.code() not in bad, (i, requests[i], exc.code(), exc.details())
            assert exc.details(), (i, exc.code())
            return exc.code().name

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(CASES)))
    assert outcomes.count("OK") > CASES // 5 and "INVALID_ARGUMENT" in outcomes, outcomes
    with grpc.insecure_channel(bg.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 10
    while bg.engine.blocks.num_free_blocks != bg.engine.blocks.num_usable_blocks:
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.05)
