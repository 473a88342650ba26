"""The batched sampler draws from the distribution it claims (temperature, top-k, top-p) and a
row's draw depends only on its own seed, step and logits, never on the rest of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from inference_worker.engine.sampler import Sampler, uniform
from inference_worker.engine.sequence import SamplingParams, Sequence
from inference_worker.engine.text_stream import TextStream

V = 12


def _seq(params: SamplingParams, generated: int = 0) -> Sequence:
    s = Sequence(request_id="r", prompt_token_ids=[1], params=params, on_output=lambda _: None,
                 text_stream=TextStream(tokenizer=None))  # type: ignore[arg-type]
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


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8),
])
def test_draws_follow_the_target_distribution(params: SamplingParams) -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 2
    expected = _expected(logits, params)
    sampler, n = Sampler(), 6000
    seqs = [_seq(SamplingParams(**{**params.__dict__, "seed": s})) for s in range(n)]
    counts = torch.bincount(torch.tensor(sampler.sample(logits.expand(n, V).clone(), seqs)), minlength=V).double()
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
    others = [_seq(SamplingParams(temperature=1.0, seed=i)) for i in range(3)] + \
        [_seq(SamplingParams(temperature=0.0))]
    alone = Sampler().sample(logits[:1].clone(), [mine])
    for perm in ([0, 1, 2, 3, 4], [4, 3, 0, 2, 1]):
        batch = [mine, *others]
        order = [batch[i] for i in perm]
        out = Sampler().sample(logits[perm].clone(), order)
        assert out[perm.index(0)] == alone[0]


def test_step_and_seed_change_the_draw_and_greedy_is_argmax() -> None:
    logits = torch.zeros(1, 1000)  # uniform: draws differ unless the noise repeats
    sampler = Sampler()
    draws = {sampler.sample(logits.clone(), [_seq(SamplingParams(temperature=1.0, seed=s), generated=n)])[0]
             for s in range(4) for n in range(4)}
    assert len(draws) > 12
    peaked = torch.randn(3, 50)
    assert Sampler().sample(peaked.clone(), [_seq(SamplingParams())] * 3) == \
        peaked.argmax(-1).tolist()


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
