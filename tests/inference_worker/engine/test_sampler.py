"""The batched sampler draws from the distribution it claims (temperature, top-k, top-p) and a
row's draw depends only on its own seed, step and logits, never on the rest of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from loraserve.inference_worker.engine.sampler import Sampler, uniform
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.text_stream import TextStream

V = 12


def _seq(params: SamplingParams, generated: int = 0) -> Sequence:
    s = Sequence(
        request_id="r",
        prompt_token_ids=[1],
        params=params,
        on_output=lambda _: None,
        text_stream=TextStream(tokenizer=None),
    )  # type: ignore[arg-type]
    s.output_token_ids.extend([0] * generated)
    return s


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution, computed the plain way in float64."""
    x = logits.double() / p.temperature
    order = torch.argsort(x, descending=True)
    probs = torch.zeros_like(x)
    keep = order[: p.top_k] if p.top_k else order
    q = torch.softmax(x[keep], -1)
    mass_before = torch.cumsum(q, 0) - q
    kept = keep[mass_before < p.top_p]
    probs[kept] = torch.softmax(x[kept], -1)
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=6, top_p=0.8),
    ],
)
def test_draws_follow_the_target_distribution(params: SamplingParams) -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2
    expected = _expected(logits, params)
    sampler, n = Sampler(), 6000
    seqs = [_seq(SamplingParams(**{**params.__dict__, "seed": s})) for s in range(n)]
    counts = torch.bincount(
        torch.tensor(sampler.sample(logits.expand(n, V).clone(), seqs)), minlength=V
    ).double()
    assert counts[expected == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    support = expected > 0
    chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum().item()
    dof = int(support.sum()) - 1
    # far beyond the 99.9th percentile of chi2(dof) for a correct sampler (mean dof, sd sqrt(2 dof))
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof, counts / n, expected)


def test_a_row_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g) * 3
    mine = _seq(SamplingParams(temperature=0.8, top_k=3, seed=42), generated=5)
    others = [_seq(SamplingParams(temperature=1.0, seed=i)) for i in range(3)] + [
        _seq(SamplingParams(temperature=0.0))
    ]
    alone = Sampler().sample(logits[:1].clone(), [mine])
    for perm in ([0, 1, 2, 3, 4], [4, 3, 0, 2, 1]):
        batch = [mine, *others]
        order = [batch[i] for i in perm]
        out = Sampler().sample(logits[perm].clone(), order)
        assert out[perm.index(0)] == alone[0]


def test_step_and_seed_change_the_draw_and_greedy_is_argmax() -> None:
    logits = torch.zeros(1, 1000)  # uniform: draws differ unless the noise repeats
    sampler = Sampler()
    draws = {
        sampler.sample(logits.clone(), [_seq(SamplingParams(temperature=1.0, seed=s), generated=n)])[0]
        for s in range(4)
        for n in range(4)
    }
    assert len(draws) > 12
    peaked = torch.randn(3, 50)
    assert Sampler().sample(peaked.clone(), [_seq(SamplingParams())] * 3) == peaked.argmax(-1).tolist()


def test_uniform_is_uniform_and_keyed_by_seed_and_step() -> None:
    u = torch.tensor([uniform(seed, step) for seed in range(200) for step in range(200)], dtype=torch.float64)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.histc(u, bins=10, min=0, max=1).min() > 3700  # 4000 expected in each tenth
    assert uniform(7, 3) == uniform(7, 3) and uniform(7, 3) != uniform(7, 4) != uniform(8, 3)


def test_top_k_rows_do_not_depend_on_the_other_rows_k() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    mine = _seq(SamplingParams(temperature=2.0, top_k=3, seed=11), generated=2)
    wide = _seq(SamplingParams(temperature=1.0, top_k=30, seed=1))
    nucleus = _seq(SamplingParams(temperature=1.0, top_p=0.5, seed=2))
    for seed in range(50):
        mine.params = SamplingParams(temperature=2.0, top_k=3, seed=seed)
        alone = Sampler().sample(logits[:1].clone(), [mine])
        assert Sampler().sample(logits.clone(), [mine, wide, nucleus])[0] == alone[0]


def _with_tokens(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = _seq(params)
    s.prompt_token_ids = list(prompt)
    s.output_token_ids.extend(output)
    return s


def _openai_penalties(
    logits: torch.Tensor, output: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c over generated tokens."""
    out = logits.clone()
    for j in set(output):
        c = output.count(j)
        out[j] -= c * frequency + presence
    return out


def test_repetition_penalty_equals_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(11)
    vocab = 50
    logits = torch.randn(4, vocab, generator=g) * 3
    cases = [([1, 2, 3, 3], [7, 8, 7], 1.3), ([5, 9], [], 0.7), ([0], [49, 48, 0], 2.0), ([4], [4], 1.0)]
    seqs = [_with_tokens(SamplingParams(repetition_penalty=r), p, o) for p, o, r in cases]
    got = Sampler().apply_penalties(logits, seqs)
    for i, (prompt, output, r) in enumerate(cases):
        want = RepetitionPenaltyLogitsProcessor(penalty=r)(
            torch.tensor([prompt + output]), logits[i : i + 1].clone()
        )
        torch.testing.assert_close(got[i], want[0])
    assert torch.equal(got[3], logits[3])  # 1.0 is off


def test_presence_and_frequency_penalties_follow_the_formula() -> None:
    g = torch.Generator().manual_seed(12)
    vocab = 30
    logits = torch.randn(3, vocab, generator=g)
    cases = [([1, 2], [3, 3, 3, 4], 0.5, 0.25), ([3], [7, 8], -1.0, 2.0), ([9], [], 2.0, 2.0)]
    seqs = [
        _with_tokens(SamplingParams(presence_penalty=pp, frequency_penalty=fp), p, o)
        for p, o, pp, fp in cases
    ]
    got = Sampler().apply_penalties(logits, seqs)
    for i, (_, output, pp, fp) in enumerate(cases):
        torch.testing.assert_close(got[i], _openai_penalties(logits[i], output, pp, fp))


def test_penalty_counts_follow_the_sampled_tokens_step_by_step() -> None:
    """The device-side counts grow with each sampled token; rows without penalties are untouched."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(13)
    vocab = 24
    sampler = Sampler()
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.5),
        SamplingParams(temperature=1.0, seed=6),
    ]
    seqs = [_with_tokens(p, [i, i + 1], [2] if i == 0 else []) for i, p in enumerate(params)]
    for _ in range(12):
        logits = torch.randn(3, vocab, generator=g)
        for i, s in enumerate(seqs[:2]):
            want = logits[i : i + 1].clone()
            p = s.params
            want = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(
                torch.tensor([s.prompt_token_ids + s.output_token_ids]), want
            )[0]
            want = _openai_penalties(want, s.output_token_ids, p.presence_penalty, p.frequency_penalty)
            torch.testing.assert_close(sampler.apply_penalties(logits, seqs)[i], want)
        assert torch.equal(sampler.apply_penalties(logits, seqs)[2], logits[2])
        expected_greedy = sampler.apply_penalties(logits, seqs)[0].argmax().item()
        out = sampler.step(logits, seqs)
        assert out.token_ids[0] == expected_greedy
        for s, t in zip(seqs, out.token_ids, strict=True):
            s.output_token_ids.append(t)
    assert len(set(seqs[1].output_token_ids)) > 4  # the frequency penalty spreads the draws
    for s in seqs:
        sampler.release(s)
    assert sampler._counts is not None and not sampler._counts._rows


def test_logprobs_are_the_models_log_softmax_with_top_alternatives() -> None:
    g = torch.Generator().manual_seed(14)
    vocab = 40
    logits = torch.randn(4, vocab, generator=g) * 2
    seqs = [
        _seq(SamplingParams(logprobs=True, top_logprobs=5)),
        _seq(SamplingParams(temperature=0.7, seed=3, logprobs=True, top_logprobs=20, repetition_penalty=1.5)),
        _seq(SamplingParams(temperature=1.0, seed=4)),
        _seq(SamplingParams(logprobs=True, frequency_penalty=2.0)),
    ]
    seqs[3].output_token_ids.extend([int(logits[3].argmax())] * 3)
    out = Sampler().step(logits, seqs)
    ref = logits.double().log_softmax(-1)  # the model's distribution: before penalties and temperature
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        k = seqs[i].params.top_logprobs
        assert [t for t, _ in lp.top] == ref[i].topk(k).indices.tolist() if k else lp.top == ()
        for t, v in lp.top:
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert out.token_ids[3] != int(logits[3].argmax())  # penalized away, its logprob still the model's
