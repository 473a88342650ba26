"""Seeded random GenerateRequests (odd and extreme prompts, chat messages, token ids, sampling
values, n, logprobs, penalties, stop lists, adapter ids, deadlines) against a real worker, many at
once: each call ends OK or with a specific status the client can act on (never INTERNAL/UNKNOWN),
health answers within 1 s all along (polled from another process) and after, the process's memory
stays bounded, and afterwards every KV block is free."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.health import HealthProbe
from tests.helpers.workers import stub_for

CASES = 160
# the largest prompt a client can send (gRPC's 4 MiB message limit) and other extremes
_HUGE = "hello world, this is text. " * 140_000
RSS_GROWTH_LIMIT = 512 << 20
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
    "text": ["", "\x00\x01", "🙂" * 20, "a" * 3000, "b" * 20_000, _HUGE],
    "token": [-3, 10**6, 2**31 - 1],
    "adapter": ["../x", "a" * 200, "no-such@" + "0" * 64, "bad@digest"],
    "stop": ["", "a" * 500, "s" * 5000],
    "stop_id": [-1, 2**31 - 1],
    "n": [-1, 9, 2**31 - 1],
    "top_logprobs": [-1, 21, 2**31 - 1],
    "penalty": [2.5, float("nan"), float("inf"), -1e30],
    "repetition": [-1.0, float("nan"), float("inf"), 1e-45],
    "role": ["robot", "", "tool"],
}


def _pick(rng: random.Random, field: str, odd: float = 0.12):
    return rng.choice(_ODD[field] if rng.random() < odd else _VALID[field])


def _count(rng: random.Random, usual: int, extreme: int) -> int:
    """Usually 0..usual, sometimes `extreme` (past the worker's limit)."""
    return extreme if rng.random() < 0.03 else rng.randint(0, usual)


def _request(rng: random.Random):
    from loraserve.v1 import worker_pb2

    sampling = worker_pb2.SamplingParams(
        max_tokens=_pick(rng, "max_tokens"),
        temperature=_pick(rng, "temperature"),
        top_k=_pick(rng, "top_k"),
        top_p=_pick(rng, "top_p"),
        stop=[_pick(rng, "stop") for _ in range(_count(rng, 2, 40))],
        stop_token_ids=[_pick(rng, "stop_id") for _ in range(_count(rng, 2, 40))],
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
        count = _count(rng, 12, 300_000)  # up to a message of token ids past any limit
        req.prompt_token_ids.extend(_pick(rng, "token") for _ in range(min(count, 12)))
        req.prompt_token_ids.extend([5] * (count - min(count, 12)))
    if kind >= 0.7:  # chat (sometimes with a prompt too, which is refused)
        for _ in range(_count(rng, 3, 2000)):
            req.messages.add(role=_pick(rng, "role", 0.1), content=_pick(rng, "text", 0.02))
        if rng.random() < 0.5:
            req.add_generation_prompt = rng.random() < 0.7
    return req


def _rss() -> int:
    """Resident bytes of this process (the worker runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_random_requests_never_break_the_worker(start_worker) -> None:
    import grpc

    bg = start_worker(max_queue_size=256)
    stub = stub_for(bg.address)
    rng = random.Random(2026)
    requests = [_request(rng) for _ in range(CASES)]
    # deadlines from already expired to ample: some calls end while queued, prefilling or decoding
    deadlines = [rng.choice([1e-4, 0.01, 0.2]) if rng.random() < 0.15 else 60.0 for _ in range(CASES)]
    bad = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

    def call(i: int) -> str:
        try:
            if i % 2:
                stub.Generate(requests[i], timeout=deadlines[i])
            else:
                for _ in stub.GenerateStream(requests[i], timeout=deadlines[i]):
                    pass
            return "OK"
        except grpc.RpcError as exc:
            assert exc.code() not in bad, (i, exc.code(), exc.details())
            assert exc.details(), (i, exc.code())
            return exc.code().name

    rss_before = _rss()
    with HealthProbe(bg.address) as probe, ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(CASES)))
    assert outcomes.count("OK") > CASES // 6, outcomes
    assert {"INVALID_ARGUMENT", "DEADLINE_EXCEEDED"} <= set(outcomes), outcomes
    assert probe.latencies and max(probe.latencies) < 1.0, sorted(probe.latencies)[-5:]
    assert _rss() - rss_before < RSS_GROWTH_LIMIT, (rss_before, _rss())
    with HealthProbe(bg.address) as after:
        pass
    assert after.latencies and max(after.latencies) < 1.0, after.latencies
    deadline = time.monotonic() + 10
    while bg.engine.blocks.num_free_blocks != bg.engine.blocks.num_usable_blocks:
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.05)
