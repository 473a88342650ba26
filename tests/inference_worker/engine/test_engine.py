"""The engine on its own, stepped on the test's thread: batching, chunking, preemption, sampling,
stop conditions, and KV blocks returning to the pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, SamplingParams
from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.errors import InvalidRequest, NoAdapterStore, QueueFull
from loraserve.inference_worker.model.loader import load_model, load_tokenizer
from tests.helpers.workers import make_engine, stream_sizes

PROMPTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Once",
    "Each worker keeps the most recently used adapters in GPU slots and the rest in a CPU cache.",
    "0123456789 + - * /",
    "loraserve serves many low-rank adapters",
]


def run_all(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = [[] for _ in requests]
    for i, (ids, params) in enumerate(requests):
        engine.submit(engine.make_sequence(f"r{i}", "", ids, params, outs[i].append))
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def alone(model_dir: Path, ids: list[int], params: SamplingParams) -> list[int]:
    return tokens(run_all(make_engine(model_dir), [(ids, params)])[0])


def test_batched_equals_alone_with_chunking_and_preemption(tiny_model_dir: Path, tok) -> None:
    reqs = [
        (tok.encode(p).ids, SamplingParams(max_tokens=10 + 7 * i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    want = [alone(tiny_model_dir, ids, sp) for ids, sp in reqs]
    # 14 usable blocks of 16 tokens cannot hold all six sequences: some are preempted and recomputed
    engine = make_engine(tiny_model_dir, num_blocks=15, max_num_batched_tokens=16, max_num_seqs=6)
    start_free = engine.num_free_blocks
    got = [tokens(o) for o in run_all(engine, reqs)]
    assert got == want
    assert engine.num_free_blocks == start_free
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_preemption_happens_and_recovers(tiny_model_dir: Path, tok) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=7, max_num_batched_tokens=16, max_num_seqs=4)
    ids = tok.encode(PROMPTS[3]).ids
    reqs = [(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(3)]
    seqs = []
    outs: list[list[RequestOutput]] = [[] for _ in reqs]
    for i, (p, sp) in enumerate(reqs):
        s = engine.make_sequence(f"p{i}", "", p, sp, outs[i].append)
        seqs.append(s)
        engine.submit(s)
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    want = alone(tiny_model_dir, ids, reqs[0][1])
    assert all(tokens(o) == want for o in outs)
    assert engine.num_free_blocks == 6


def test_long_prompt_is_chunked_while_others_decode(tiny_model_dir: Path, tok) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)
    short = tok.encode("Hello").ids
    long = (tok.encode(PROMPTS[3]).ids * 3)[:60]
    outs: list[list[RequestOutput]] = [[], []]
    engine.submit(
        engine.make_sequence(
            "short", "", short, SamplingParams(max_tokens=30, ignore_eos=True), outs[0].append
        )
    )
    engine.step()
    engine.submit(
        engine.make_sequence("long", "", long, SamplingParams(max_tokens=5, ignore_eos=True), outs[1].append)
    )
    steps_before_long_token = 0
    while not outs[1]:
        engine.step()
        steps_before_long_token += 1
    # the 60-token prompt took several steps, and the short sequence decoded in each of them
    assert steps_before_long_token >= 60 // 8
    assert len(tokens(outs[0])) >= steps_before_long_token


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir: Path, tok) -> None:
    ids = tok.encode(PROMPTS[1]).ids
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    a = alone(tiny_model_dir, ids, sp)
    others = [
        (tok.encode(p).ids, SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    batched = run_all(make_engine(tiny_model_dir), [*others[:3], (ids, sp), *others[3:]])
    assert tokens(batched[3]) == a
    other_seed = alone(tiny_model_dir, ids, SamplingParams(**{**sp.__dict__, "seed": 99}))
    assert other_seed != a
    greedy = alone(tiny_model_dir, ids, SamplingParams(max_tokens=24, ignore_eos=True))
    assert a != greedy


def test_top_k_one_is_greedy(tiny_model_dir: Path, tok) -> None:
    ids = tok.encode(PROMPTS[0]).ids
    greedy = alone(tiny_model_dir, ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert (
        alone(
            tiny_model_dir,
            ids,
            SamplingParams(max_tokens=12, temperature=5.0, top_k=1, seed=3, ignore_eos=True),
        )
        == greedy
    )
    assert (
        alone(
            tiny_model_dir,
            ids,
            SamplingParams(max_tokens=12, temperature=5.0, top_p=1e-6, seed=3, ignore_eos=True),
        )
        == greedy
    )


def test_stop_token_ids_eos_and_length(tiny_model_dir: Path, tok) -> None:
    ids = tok.encode(PROMPTS[0]).ids
    full = alone(tiny_model_dir, ids, SamplingParams(max_tokens=12, ignore_eos=True))
    engine = make_engine(tiny_model_dir)
    [outs] = run_all(
        engine, [(ids, SamplingParams(max_tokens=12, stop_token_ids=(full[4],), ignore_eos=True))]
    )
    cut = full.index(full[4])
    assert tokens(outs) == full[:cut] and outs[-1].finish_reason is FinishReason.STOP
    engine.requests.eos_token_ids = frozenset({full[4]})
    [outs] = run_all(engine, [(ids, SamplingParams(max_tokens=12))])
    assert tokens(outs) == full[:cut] and outs[-1].finish_reason is FinishReason.EOS
    [outs] = run_all(engine, [(ids, SamplingParams(max_tokens=3, ignore_eos=True))])
    assert tokens(outs) == full[:3] and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage.completion_tokens == 3 and outs[-1].usage.prompt_tokens == len(ids)


def test_stop_string_across_token_boundaries(tiny_model_dir: Path, tok) -> None:
    ids = tok.encode(PROMPTS[2]).ids
    engine = make_engine(tiny_model_dir)
    [full] = run_all(engine, [(ids, SamplingParams(max_tokens=40, ignore_eos=True))])
    text = "".join(o.text for o in full)
    out_ids = tokens(full)
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tok.decode(out_ids[:i]) for i in range(len(out_ids) + 1)]
    i = next(i for i in range(2, len(pieces) - 2) if len(pieces[i + 1]) - len(pieces[i]) >= 2)
    start = len(pieces[i]) - 1 if len(pieces[i]) > len(pieces[i - 1]) else len(pieces[i])
    stop = text[start : len(pieces[i + 1]) + 1]
    assert len(stop) >= 3
    expected = text[: text.find(stop)]
    [outs] = run_all(
        engine, [(ids, SamplingParams(max_tokens=40, stop=(stop, "never-there"), ignore_eos=True))]
    )
    assert "".join(o.text for o in outs) == expected
    assert outs[-1].finish_reason is FinishReason.STOP


def test_text_stream_holds_back_possible_stop_prefix(tok) -> None:
    ts = TextStream(tok, ("fox jumps",))
    released = ""
    for t in tok.encode("The quick brown fox jumps over").ids:
        if ts.append(t):
            break
        released += ts.take(final=False)
        assert "fox" not in released  # never released while it may begin the stop string
    released += ts.take(final=True)
    assert released == "The quick brown "


def test_text_stream_releases_the_decoded_text_up_to_a_stop(tok) -> None:
    """Random ids (special tokens, characters split across byte-level tokens): what the stream
    releases, chunk by chunk, adds up to the tokenizer's decode of all of them, cut at a stop string."""
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    text = "naïve café, 日本語 🙂 and the quick brown fox"
    for trial in range(300):
        ids = (
            tok.encode(text).ids if trial % 2 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        )
        ids = ids[: rng.randrange(1, len(ids) + 1)]
        full = tok.decode(ids, skip_special_tokens=True)
        stop = full[(a := rng.randrange(len(full))) : a + 3] if full and trial % 3 == 0 else ""
        stop = "" if "\ufffd" in stop else stop  # an unfinished character is released only at the end
        ts = TextStream(tok, (stop,))
        released = ""
        for t in ids:
            if ts.append(t):
                break
            chunk = ts.take(final=False)
            assert "\ufffd" not in chunk or "\ufffd" in full
            released += chunk
        released += ts.take(final=True)
        assert released == (full[: full.find(stop)] if stop else full), (ids, stop)


def test_validation(tiny_model_dir: Path, tok) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64, max_queue_size=2, default_max_tokens=7)
    ids = tok.encode(PROMPTS[0]).ids

    def make(**kw):
        return engine.make_sequence(
            "v", "", kw.pop("ids", ids), SamplingParams(**kw), lambda _: None, kw.pop("adapter_id", "")
        )

    for bad in (
        dict(temperature=-0.5),
        dict(top_p=1.5),
        dict(top_p=0.0),
        dict(top_k=-1),
        dict(max_tokens=-1),
        dict(max_tokens=64),
        dict(ids=[]),
        dict(ids=[10**6]),
    ):
        with pytest.raises(InvalidRequest):
            make(**bad)
    with pytest.raises(NoAdapterStore, match="no adapter store configured"):
        engine.make_sequence("a", "", ids, SamplingParams(), lambda _: None, "some-adapter")
    assert make(max_tokens=0).params.max_tokens == 7  # 0 = server default
    engine.submit(engine.make_sequence("q1", "hi", [], SamplingParams(), lambda _: None))
    engine.submit(engine.make_sequence("q2", "hi", [], SamplingParams(), lambda _: None))
    with pytest.raises(QueueFull):
        engine.submit(engine.make_sequence("q3", "hi", [], SamplingParams(), lambda _: None))


def test_fill_context_asks_for_the_room_the_context_leaves(tiny_model_dir: Path, tok) -> None:
    """max_tokens 0 with fill_context: max_model_len less the prompt (OpenAI chat's default), or
    the KV cache less the prompt where that is smaller; an explicit max_tokens still wins."""
    ids = tok.encode(PROMPTS[0]).ids

    def max_tokens(engine: LLMEngine, **kw) -> int:
        seq = engine.make_sequence("f", "", ids, SamplingParams(**kw), lambda _: None)
        return seq.params.max_tokens

    engine = make_engine(tiny_model_dir, max_model_len=64, num_blocks=64, default_max_tokens=7)
    assert max_tokens(engine, max_tokens=0, fill_context=True) == 64 - len(ids)
    assert max_tokens(engine, max_tokens=3, fill_context=True) == 3
    assert max_tokens(engine, max_tokens=0) == 7
    small_kv = make_engine(tiny_model_dir, max_model_len=512, num_blocks=5)  # 4 usable blocks of 16
    assert max_tokens(small_kv, max_tokens=0, fill_context=True) == 4 * 16 - len(ids)
    long = (ids * (64 // len(ids) + 1))[:64]  # a prompt the size of that KV cache
    with pytest.raises(
        InvalidRequest,
        match=r"prompt \(64 tokens\) leaves no room to generate within the KV cache \(64 tokens\)",
    ):
        small_kv.make_sequence("g", "", long, SamplingParams(max_tokens=0, fill_context=True), lambda _: None)


def test_abort_frees_blocks(tiny_model_dir: Path, tok) -> None:
    engine = make_engine(tiny_model_dir)
    start = engine.num_free_blocks
    outs: list[RequestOutput] = []
    engine.submit(
        engine.make_sequence(
            "x", "", tok.encode(PROMPTS[3]).ids, SamplingParams(max_tokens=200, ignore_eos=True), outs.append
        )
    )
    for _ in range(5):
        engine.step()
    assert engine.num_free_blocks < start
    engine.abort("x")
    engine.step()
    assert engine.num_free_blocks == start
    assert outs[-1].finish_reason is FinishReason.CANCELLED


def test_decode_graphs_are_captured_once_when_the_engine_starts(tiny_model_dir) -> None:
    """The runner captures its decode graphs when the engine starts — with the LoRA path, since
    the engine was built with adapters — and never again; steps before that run eagerly."""

    class BaseRequestsOnly:  # the engine's adapter seam, with no adapter ever resident
        def validate(self, seq) -> None:
            pass

        def can_admit(self, seq) -> bool:
            return not seq.adapter_id

        def look_ahead(self, waiting) -> None:
            pass

        def on_finished(self, seq) -> None:
            pass

        def lora_batch(self, token_slots):
            raise AssertionError("no step of this test has adapter rows")

    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, num_blocks=32, use_cuda_graphs=True)
    model = load_model(tiny_model_dir, torch.float32, "cpu")
    engine = LLMEngine(model, load_tokenizer(tiny_model_dir), cfg, BaseRequestsOnly())
    runner = engine.runner
    captures: list[bool] = []

    def fake_capture() -> None:  # stands in for the CUDA capture: records which path it carries
        captures.append(runner._graphs.adapters is not None)
        runner._graphs.decode = {1: object()}  # type: ignore[dict-item]

    runner._want_graphs = True  # as on a CUDA device
    runner._capture_graphs = fake_capture
    outs: list[RequestOutput] = []
    engine.submit(engine.make_sequence("eager", "", [5, 6, 7], SamplingParams(max_tokens=1), outs.append))
    engine.step()  # a step before start: eager, nothing captured
    assert outs[-1].finished
    assert captures == []
    engine.start()
    try:
        assert captures == [True]  # once, with the LoRA path
        runner.capture_graphs()
        assert captures == [True]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("every", [2, 3, 5])
def test_stream_interval_groups_tokens_without_changing_them(tiny_model_dir: Path, tok, every: int) -> None:
    """With stream_interval k a running request's outputs carry k tokens each: its first token at
    once, its end (a length, or a stop string across outputs) whenever it comes; the tokens, text
    and ending are those of k = 1."""
    requests = [
        (tok.encode(PROMPTS[1]).ids, SamplingParams(max_tokens=17, ignore_eos=True)),
        (tok.encode(PROMPTS[2]).ids, SamplingParams(max_tokens=1, ignore_eos=True)),
    ]
    one = run_all(make_engine(tiny_model_dir), requests)
    text = "".join(o.text for o in one[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    requests.append((requests[0][0], SamplingParams(max_tokens=17, stop=(stop,), ignore_eos=True)))
    one = run_all(make_engine(tiny_model_dir), requests)
    grouped = run_all(make_engine(tiny_model_dir, stream_interval=every), requests)
    for a, b in zip(one, grouped, strict=True):
        assert tokens(b) == tokens(a) and "".join(o.text for o in b) == "".join(o.text for o in a)
        assert b[-1].finish_reason is a[-1].finish_reason
        assert b[-1].usage.completion_tokens == a[-1].usage.completion_tokens
        assert len(b[0].token_ids) == 1  # the first token is not held back
        assert all(len(o.token_ids) == every for o in b[1:-1])
    assert one[2][-1].finish_reason is FinishReason.STOP
    assert len(grouped[0]) < len(one[0])


@pytest.mark.parametrize("worker_every, request_every", [(1, 4), (1, 7), (4, 1), (3, 5)])
def test_a_request_s_stream_interval_overrides_the_engine_s(
    tiny_model_dir: Path, tok, worker_every: int, request_every: int
) -> None:
    """SamplingParams.stream_interval k groups that request's outputs whatever the engine's
    stream_interval (1 included): [1, k, ..., k, rest] for each of its n completions, the same
    tokens, text and logprobs; a request leaving it 0 keeps the engine's."""
    ids = tok.encode(PROMPTS[3]).ids
    kw = dict(max_tokens=18, ignore_eos=True, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2)
    requests = [
        (ids, SamplingParams(**kw)),  # type: ignore[arg-type]
        (ids, SamplingParams(**kw, stream_interval=request_every)),  # type: ignore[arg-type]
        (tok.encode(PROMPTS[0]).ids, SamplingParams(max_tokens=1, stream_interval=request_every)),
    ]
    one = run_all(make_engine(tiny_model_dir), requests[:1])[0]
    default, grouped, single = run_all(make_engine(tiny_model_dir, stream_interval=worker_every), requests)
    for index in (0, 1):
        want = [o for o in one if o.index == index]
        for outs, every in ((default, worker_every), (grouped, request_every)):
            got = [o for o in outs if o.index == index]
            assert [len(o.token_ids) for o in got] == stream_sizes(18, every)
            assert tokens(got) == tokens(want) and "".join(o.text for o in got) == "".join(
                o.text for o in want
            )
            # (the batch differs from the lone request's: logprobs agree to float rounding)
            lps, want_lps = [lp for o in got for lp in o.logprobs], [lp for o in want for lp in o.logprobs]
            assert [lp.token_id for lp in lps] == [lp.token_id for lp in want_lps] == tokens(got)
            assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want_lps], abs=1e-4)
            assert all(len(o.logprobs) == len(o.token_ids) for o in got)
            assert got[-1].finish_reason is FinishReason.LENGTH and not any(o.finished for o in got[:-1])
    assert grouped[-1].last and grouped[-1].usage.completion_tokens == 36
    assert [len(o.token_ids) for o in single] == [1] and single[0].finished


def test_a_stream_interval_out_of_range_is_refused(tiny_model_dir: Path, tok) -> None:
    engine = make_engine(tiny_model_dir)
    ids = tok.encode(PROMPTS[0]).ids
    for k in (-1, 1025):
        with pytest.raises(InvalidRequest, match=r"stream_interval must be in \[0, 1024\]"):
            engine.make_sequence("r", "", ids, SamplingParams(stream_interval=k), lambda out: None)
    engine.make_sequence("r", "", ids, SamplingParams(stream_interval=1024), lambda out: None)


def test_a_request_submitted_while_the_step_checks_deadlines_changes_nothing(
    tiny_model_dir: Path, tok
) -> None:
    """submit() runs on the event loop while the step thread looks for expired deadlines: a request
    added in the middle of that scan must neither break the step (and with it every running
    request) nor be lost."""
    engine = make_engine(tiny_model_dir)
    ids = tok.encode("Hello world.").ids
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs: list[list[RequestOutput]] = [[] for _ in range(3)]
    engine.submit(engine.make_sequence("r0", "", ids, params, outs[0].append))
    engine.submit(engine.make_sequence("r1", "", ids, params, outs[1].append))

    class SubmitsOnRead:  # the scan reads each running request's deadline
        submitted = False

        def __get__(self, seq, owner=None):
            if seq is not None and not SubmitsOnRead.submitted:
                SubmitsOnRead.submitted = True  # as if the event loop's submit ran just now
                engine.submit(engine.make_sequence("r2", "", ids, params, outs[2].append))
            return None

        def __set__(self, seq, value) -> None:  # a data descriptor: the instance's value is not read
            pass

    seq0 = engine._by_request["r0"].seqs[0]
    seq0.__class__ = type("ScannedSequence", (type(seq0),), {"deadline": SubmitsOnRead()})
    for _ in range(50):
        engine.step()
        if all(o and o[-1].finished for o in outs):
            break
    assert SubmitsOnRead.submitted
    assert [o[-1].error for o in outs] == [None, None, None]
    assert [len(tokens(o)) for o in outs] == [3, 3, 3]
