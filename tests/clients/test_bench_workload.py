"""The request stream of `loraserve bench`: reproducible from its seed, and distributed as asked
(Zipf and uniform popularity, base-model share, Poisson arrivals, length ranges). Statistical
checks run on fixed seeds with tolerances several standard errors wide."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from loraserve.clients.bench.workload import (
    RequestStream,
    WorkloadSpec,
    adapter_ids,
    load_prompts,
    zipf_weights,
)

IDS = adapter_ids(10)


def test_same_seed_same_stream_and_each_iteration_restarts() -> None:
    spec = WorkloadSpec(
        adapter_ids=IDS,
        popularity="zipf",
        base_share=0.2,
        prompt_len=(4, 40),
        output_len=(1, 9),
        rate=5.0,
        seed=7,
    )
    a, b = RequestStream(spec).take(300), RequestStream(spec).take(300)
    assert a == b and [r.prompt for r in a] == [r.prompt for r in b]
    stream = RequestStream(spec)
    assert stream.take(50) == stream.take(50)
    other = RequestStream(replace(spec, seed=8)).take(300)
    assert [r.adapter_id for r in other] != [r.adapter_id for r in a]


def test_aspects_are_independent_of_each_other() -> None:
    spec = WorkloadSpec(adapter_ids=IDS, popularity="zipf", rate=5.0, seed=3)
    base = RequestStream(spec).take(200)
    faster = RequestStream(replace(spec, rate=50.0)).take(200)
    longer = RequestStream(replace(spec, output_len=(5, 50))).take(200)
    assert [r.adapter_id for r in faster] == [r.adapter_id for r in base]
    assert [r.arrival_s for r in faster] != [r.arrival_s for r in base]
    assert [r.adapter_id for r in longer] == [r.adapter_id for r in base]
    assert [r.arrival_s for r in longer] == [r.arrival_s for r in base]


def test_zipf_frequencies_follow_the_power_law() -> None:
    n, s, draws = 20, 1.0, 40_000
    ids = adapter_ids(n)
    spec = WorkloadSpec(adapter_ids=ids, popularity="zipf", zipf_exponent=s, seed=11)
    counts = Counter(r.adapter_id for r in RequestStream(spec).take(draws))
    weights = zipf_weights(n, s)
    total = sum(weights)
    for rank, aid in enumerate(ids):
        p = weights[rank] / total
        se = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[aid] / draws - p) < 5 * se, (aid, counts[aid] / draws, p)
    # the head is about twice the second and ten times the tenth, as 1/k says
    assert 1.8 < counts[ids[0]] / counts[ids[1]] < 2.2
    assert 8.0 < counts[ids[0]] / counts[ids[9]] < 12.0


def test_uniform_popularity_and_base_share() -> None:
    draws = 30_000
    spec = WorkloadSpec(adapter_ids=IDS, base_share=0.25, seed=5)
    counts = Counter(r.adapter_id for r in RequestStream(spec).take(draws))
    assert abs(counts[""] / draws - 0.25) < 5 * math.sqrt(0.25 * 0.75 / draws)
    p = 0.75 / len(IDS)
    for aid in IDS:
        assert abs(counts[aid] / draws - p) < 5 * math.sqrt(p * (1 - p) / draws)
    only_base = WorkloadSpec(base_share=1.0, seed=5)
    assert {r.adapter_id for r in RequestStream(only_base).take(100)} == {""}


def test_poisson_arrivals_have_exponential_gaps() -> None:
    rate, n = 40.0, 20_000
    reqs = RequestStream(WorkloadSpec(adapter_ids=IDS, rate=rate, seed=2)).take(n)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = sum(gaps) / n
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    # exponential: mean 1/rate (standard error (1/rate)/sqrt(n)), coefficient of variation 1
    assert abs(mean - 1 / rate) < 5 * (1 / rate) / math.sqrt(n)
    assert 0.95 < sd / mean < 1.05
    # memorylessness: P(gap > 2/rate) = e^-2
    tail = sum(g > 2 / rate for g in gaps) / n
    assert abs(tail - math.exp(-2)) < 5 * math.sqrt(math.exp(-2) * (1 - math.exp(-2)) / n)
    closed = RequestStream(WorkloadSpec(adapter_ids=IDS, seed=2)).take(10)
    assert {r.arrival_s for r in closed} == {0.0}


def test_lengths_stay_in_their_ranges_and_cover_them() -> None:
    spec = WorkloadSpec(adapter_ids=IDS, prompt_len=(3, 9), output_len=(2, 5), vocab_size=50, seed=1)
    reqs = RequestStream(spec).take(2000)
    assert {len(r.prompt) for r in reqs} == set(range(3, 10))
    assert {r.max_tokens for r in reqs} == set(range(2, 6))
    assert {t for r in reqs for t in r.prompt} <= set(range(50))
    assert all(r.prompt_len == len(r.prompt) for r in reqs)


def test_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "prompts.jsonl"
    lines = [
        '"plain text"',
        json.dumps({"prompt": "with length", "max_tokens": 7}),
        "",
        json.dumps({"prompt": "x"}),
    ]
    f.write_text("\n".join(lines) + "\n")
    prompts = load_prompts(f)
    assert [p.text for p in prompts] == ["plain text", "with length", "x"]
    reqs = RequestStream(WorkloadSpec(adapter_ids=IDS, prompts=prompts, output_len=(20, 30), seed=4)).take(
        300
    )
    assert {r.prompt for r in reqs} == {"plain text", "with length", "x"}
    assert all(r.max_tokens == 7 for r in reqs if r.prompt == "with length")
    assert all(20 <= r.max_tokens <= 30 for r in reqs if r.prompt != "with length")
    assert all(r.prompt_len is None for r in reqs)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "prompts.jsonl:1: not JSON"),
        ('"ok"\n{"text": "no prompt key"}\n', "prompts.jsonl:2"),
        ('{"prompt": "a", "max_tokens": 0}\n', "max_tokens must be a positive integer"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(f)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(popularity="pareto"), "popularity must be one of"),
        (dict(popularity="zipf", zipf_exponent=-1.0), "zipf exponent"),
        (dict(base_share=1.5), "base share"),
        (dict(adapter_ids=()), "no adapter ids"),
        (dict(adapter_ids=("a", "a")), "distinct"),
        (dict(prompt_len=(5, 2)), "prompt length"),
        (dict(output_len=(0, 2)), "output length"),
        (dict(rate=0.0), "rate"),
        (dict(rate=math.inf), "rate"),
    ],
)
def test_bad_specs_say_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**{"adapter_ids": IDS, **kwargs})


def test_adapter_id_format() -> None:
    assert adapter_ids(3, "lora-{i}") == ("lora-0", "lora-1", "lora-2")
    with pytest.raises(ValueError, match="distinct"):
        adapter_ids(3, "same")
