"""n > 1 completions of one prompt: the prompt is computed once and its KV shared (full blocks by
reference, the partial last block copied), and completion i equals a lone request with seed + i."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, SamplingParams
from loraserve.inference_worker.errors import InvalidRequest
from tests.helpers.engine_run import completions, generate, run_request
from tests.helpers.workers import make_engine


def run_n(engine, ids: list[int], params: SamplingParams, rid: str = "r") -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    return run_request(engine, engine.make_sequence(rid, "", ids, params, outs.append), outs)


@pytest.mark.parametrize("prompt_len", [21, 32])  # a partial last block (copied), only full blocks
def test_n_sampled_completions_equal_lone_requests_and_prefill_once(tiny_model_dir: Path, prompt_len) -> None:
    ids = [(7 * i + 3) % 500 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=100, ignore_eos=True, n=4)
    engine = make_engine(tiny_model_dir, block_size=16)
    free = engine.num_free_blocks
    outs = run_n(engine, ids, params)
    assert engine.num_prefill_tokens == prompt_len  # the prompt ran through the model once
    got = completions(outs)
    lone = make_engine(tiny_model_dir, block_size=16)
    want = [
        generate(lone, ids, SamplingParams(**{**params.__dict__, "n": 1, "seed": 100 + i})) for i in range(4)
    ]
    assert got == want
    assert len({tuple(t) for t in got}) == 4
    assert engine.num_free_blocks == free and engine.idle
    # each index finished once; only the very last output carries the usage, counting all tokens
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2, 3]
    assert [o.usage is not None for o in outs] == [False] * (len(outs) - 1) + [True]
    u = outs[-1].usage
    assert u.prompt_tokens == prompt_len and u.completion_tokens == 80


def test_n_greedy_completions_are_equal(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    ids = list(range(40, 61))
    outs = run_n(
        engine, ids, SamplingParams(max_tokens=12, ignore_eos=True, n=3, logprobs=True, top_logprobs=2)
    )
    got = completions(outs)
    assert (
        got[0]
        == got[1]
        == got[2]
        == generate(make_engine(tiny_model_dir), ids, SamplingParams(max_tokens=12))
    )
    lps = [[lp for o in outs if o.index == i for lp in o.logprobs] for i in range(3)]
    assert [lp.token_id for lp in lps[0]] == got[0]
    for other in lps[1:]:  # equal up to float rounding of the rows' places in the batch
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in other] == [
            (lp.token_id, [t for t, _ in lp.top]) for lp in lps[0]
        ]
        assert [lp.logprob for lp in other] == pytest.approx([lp.logprob for lp in lps[0]], abs=1e-5)


def test_siblings_without_a_free_block_recompute_the_prompt(tiny_model_dir: Path) -> None:
    """With too few blocks to copy the partial block, siblings compute their own prompt later
    and still equal lone requests."""
    ids = list(range(100, 121))  # 21 tokens: 2 blocks of 16, the second partial
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=9, ignore_eos=True, n=3)
    # 3 usable blocks: the first sequence holds 2, so one sibling forks and the other waits
    engine = make_engine(tiny_model_dir, num_blocks=4, max_num_batched_tokens=32)
    outs = run_n(engine, ids, params)
    assert engine.num_prefill_tokens > len(ids)  # someone recomputed
    want = [
        generate(
            make_engine(tiny_model_dir), ids, SamplingParams(**{**params.__dict__, "n": 1, "seed": 9 + i})
        )
        for i in range(3)
    ]
    assert completions(outs) == want
    assert engine.num_free_blocks == 3


def test_preemption_of_forked_siblings(tiny_model_dir: Path) -> None:
    """Siblings that share blocks are preempted and recomputed without corrupting each other."""
    ids = list(range(200, 233))  # 33 tokens
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=21, ignore_eos=True, n=3)
    engine = make_engine(tiny_model_dir, num_blocks=9, max_num_batched_tokens=16)
    outs: list[RequestOutput] = []
    seq = engine.make_sequence("p", "", ids, params, outs.append)
    group = seq.group  # (let go of when the request ends)
    run_request(engine, seq, outs)
    assert group is not None and sum(s.num_preemptions for s in group.seqs) > 0
    want = [
        generate(
            make_engine(tiny_model_dir), ids, SamplingParams(**{**params.__dict__, "n": 1, "seed": 21 + i})
        )
        for i in range(3)
    ]
    assert completions(outs) == want
    assert engine.num_free_blocks == 8


def test_stop_and_finish_reasons_per_completion(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    ids = list(range(10, 30))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, n=3)
    free = completions(run_n(engine, ids, params))
    stop = free[1][2]  # stops completion 1 at its third token; the others where they have it
    outs = run_n(engine, ids, SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)}), rid="s")
    got = completions(outs)
    reasons = {o.index: o.finish_reason for o in outs if o.finished}
    for i in range(3):
        cut = free[i].index(stop) if stop in free[i] else None
        assert got[i] == free[i][:cut]
        assert reasons[i] is (FinishReason.STOP if cut is not None else FinishReason.LENGTH)


def test_abort_ends_every_completion_and_frees_blocks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    free = engine.num_free_blocks
    outs: list[RequestOutput] = []
    seq = engine.make_sequence(
        "a", "", list(range(50)), SamplingParams(max_tokens=100, ignore_eos=True, n=4), outs.append
    )
    engine.submit(seq)
    engine.step()  # the prompt's first chunk: the siblings are still waiting for its KV
    engine.abort("a")
    engine.step()
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2, 3]
    assert all(o.finish_reason is FinishReason.CANCELLED for o in outs if o.finished)
    assert outs[-1].usage is not None and engine.idle and engine.num_free_blocks == free
    outs.clear()
    seq = engine.make_sequence(
        "b", "", list(range(20)), SamplingParams(max_tokens=100, ignore_eos=True, n=3), outs.append
    )
    engine.submit(seq)
    for _ in range(4):
        engine.step()
    assert engine.num_running == 3
    engine.abort("b")
    engine.step()
    assert outs[-1].usage is not None and engine.idle and engine.num_free_blocks == free


def test_bad_n(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    for n in (0, -1, 5):
        with pytest.raises(InvalidRequest, match="n must be"):
            engine.make_sequence("x", "", [1, 2], SamplingParams(n=n), lambda _: None)
