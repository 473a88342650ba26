"""Asynchronous scheduling (the next step planned and launched before the last one's tokens are read
back) gives what the synchronous engine gives: the same tokens, text, stop and length endings,
logprobs and usage, with chunked prefill, preemption, penalties, seeded sampling and n > 1; a
sequence that ends is stepped at most once more, every KV block comes back, and the running set
never outgrows max_num_seqs."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, SamplingParams
from loraserve.inference_worker.model.loader import load_tokenizer
from tests.helpers.engine_run import completions
from tests.helpers.workers import make_engine
from tests.inference_worker.engine.test_engine import PROMPTS


def run(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], seqs: list | None = None
) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = [[] for _ in requests]
    for i, (ids, params) in enumerate(requests):
        seq = engine.make_sequence(f"r{i}", "", ids, params, outs[i].append)
        if seqs is not None:
            seqs.append(seq)
        engine.submit(seq)
    steps = 0
    while not all(o and o[-1].last for o in outs):
        engine.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        # siblings that fork later hold their places from their request's admission
        assert len(engine.scheduler.running) <= engine.scheduler.max_num_seqs
    return outs


def summary(outs: list[RequestOutput]) -> dict:
    n = max(o.index for o in outs) + 1
    text = ["".join(o.text for o in outs if o.index == i) for i in range(n)]
    reasons = {o.index: o.finish_reason for o in outs if o.finished}
    logprobs = [
        [(lp.token_id, [t for t, _ in lp.top]) for o in outs if o.index == i for lp in o.logprobs]
        for i in range(n)
    ]
    usage = outs[-1].usage
    assert usage is not None
    return dict(
        tokens=completions(outs),
        text=text,
        reasons=reasons,
        logprobs=logprobs,
        completion_tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
    )


def logprob_values(outs: list[RequestOutput]) -> list[float]:
    return [lp.logprob for o in outs for lp in o.logprobs]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def workload(tiny_model_dir: Path, tok) -> list[tuple[list[int], SamplingParams]]:
    ids = [tok.encode(p).ids for p in PROMPTS]
    # a stop string and a stop token that the model does produce (from a synchronous greedy run)
    probe = run(
        make_engine(tiny_model_dir, async_scheduling=False),
        [(ids[1], SamplingParams(max_tokens=24, ignore_eos=True))],
    )[0]
    text = "".join(o.text for o in probe)
    gen = completions(probe)[0]
    assert len(text) > 8 and len(gen) == 24
    stop = text[6:9]
    return [
        (ids[0], SamplingParams(max_tokens=30, ignore_eos=True)),
        (ids[1], SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True)),
        (ids[1], SamplingParams(max_tokens=24, stop_token_ids=(gen[10],), ignore_eos=True)),
        (ids[2], SamplingParams(max_tokens=1, ignore_eos=True)),
        (ids[2], SamplingParams(max_tokens=2, temperature=0.9, seed=5, ignore_eos=True)),
        (
            ids[3],
            SamplingParams(max_tokens=40, temperature=1.0, top_k=20, top_p=0.8, seed=7, ignore_eos=True),
        ),
        (
            ids[4],
            SamplingParams(
                max_tokens=25,
                temperature=0.7,
                seed=11,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.2,
                logprobs=True,
                top_logprobs=3,
                ignore_eos=True,
            ),
        ),
        (ids[5], SamplingParams(max_tokens=18, temperature=1.0, seed=3, n=3, ignore_eos=True)),
        (ids[0], SamplingParams(max_tokens=33, logprobs=True, top_logprobs=2, ignore_eos=True)),
        (ids[3], SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True)),
    ]


@pytest.mark.parametrize(
    "sizes",
    [
        dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8),
        # 7 usable blocks of 16 tokens for ten requests: preemption and recompute; chunked prompts
        dict(num_blocks=8, max_num_batched_tokens=16, max_num_seqs=6),
    ],
    ids=["roomy", "preempting"],
)
def test_async_scheduling_gives_what_the_synchronous_engine_gives(tiny_model_dir: Path, tok, sizes) -> None:
    reqs = workload(tiny_model_dir, tok)
    sync_engine = make_engine(tiny_model_dir, async_scheduling=False, **sizes)
    async_engine = make_engine(tiny_model_dir, async_scheduling=True, **sizes)
    assert not sync_engine.async_scheduling and async_engine.async_scheduling
    free = async_engine.num_free_blocks
    want = run(sync_engine, reqs)
    seqs: list = []
    got = run(async_engine, reqs, seqs)
    for w, g in zip(want, got, strict=True):
        assert summary(g) == summary(w)
        assert logprob_values(g) == pytest.approx(logprob_values(w), rel=1e-4, abs=1e-5)
    assert {r for o in got for r in summary(o)["reasons"].values()} == {
        FinishReason.LENGTH,
        FinishReason.STOP,
    }
    # at most one step more per ended sequence, and nothing left behind
    assert async_engine.num_steps <= sync_engine.num_steps + 3 * sum(p.n for _, p in reqs)
    assert async_engine.idle and async_engine.num_free_blocks == free
    assert not async_engine.scheduler.has_work and async_engine._inflight is None
    assert (sum(s.num_preemptions for s in seqs) > 0) == (sizes["num_blocks"] < 20)
    assert all(s.num_pending == 0 for s in seqs)


def test_an_aborted_request_ends_and_the_others_are_unchanged(tiny_model_dir: Path, tok) -> None:
    ids = [tok.encode(p).ids for p in PROMPTS]
    reqs = [(ids[i], SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(3)]
    want = run(make_engine(tiny_model_dir, async_scheduling=False), reqs)
    engine = make_engine(tiny_model_dir, async_scheduling=True)
    free = engine.num_free_blocks
    outs: list[list[RequestOutput]] = [[] for _ in range(4)]
    for i, (p, params) in enumerate([*reqs, (ids[3], SamplingParams(max_tokens=200, ignore_eos=True))]):
        engine.submit(engine.make_sequence(f"r{i}", "", p, params, outs[i].append))
    for _ in range(6):
        engine.step()
    engine.abort("r3")  # while a step of it is launched and not read back
    while not all(o and o[-1].last for o in outs):
        engine.step()
    assert outs[3][-1].finish_reason is FinishReason.CANCELLED
    assert 0 < len(completions(outs[3])[0]) < 200
    for w, g in zip(want, outs[:3], strict=True):
        assert completions(g) == completions(w)
    assert engine.idle and engine.num_free_blocks == free


def test_off_on_cpu_by_default_and_a_step_then_delivers_its_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    assert not engine.async_scheduling  # on CUDA only, unless asked for
    outs: list[RequestOutput] = []
    engine.submit(engine.make_sequence("a", "", [5, 6, 7], SamplingParams(max_tokens=1), outs.append))
    engine.step()
    assert outs and outs[-1].finished
    forced = make_engine(tiny_model_dir, async_scheduling=True)
    outs = []
    forced.submit(forced.make_sequence("a", "", [5, 6, 7], SamplingParams(max_tokens=1), outs.append))
    forced.step()  # launched, not read back yet
    assert not outs
    forced.step()  # nothing to run: the launched step is read back
    assert outs and outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH


def test_steps_stay_full_while_requests_wait(tiny_model_dir: Path) -> None:
    """With requests always waiting, every step carries max_num_seqs sequences but for those whose
    last token is still on the device (ended by length: not stepped again)."""
    import random

    engine = make_engine(
        tiny_model_dir, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=256, max_queue_size=64
    )
    rng = random.Random(0)
    short: list[int] = []  # per step: places left empty, beyond the sequences ending on the device
    outcomes: list[str] = []  # what ended each step's admission
    schedule = engine.scheduler.schedule

    def recording():
        sched = schedule()
        outcomes.append(sched.admission)
        ending = sum(1 for s in engine.scheduler.running if s.ends_with_pending)
        short.append(8 - len(sched.prefills) - len(sched.decodes) - ending)
        return sched

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    for i in range(400):
        while engine.num_running + engine.num_waiting < 16:
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))]
            params = SamplingParams(max_tokens=rng.randrange(4, 48), ignore_eos=True)
            engine.submit(
                engine.make_sequence(f"r{i}-{engine.num_waiting}", "", prompt, params, lambda out: None)
            )
        engine.step()
    assert short[5:] == [0] * len(short[5:])
    assert set(outcomes[5:]) == {"max_num_seqs"}  # and the worker's metrics say why
