"""The step plan's per-token lists built by slices and runs (model_runner.cache_slots,
Sequence.tokens_between) equal their one-position-at-a-time definitions."""

from __future__ import annotations

import random

from loraserve.inference_worker.engine.model_runner import cache_slots
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.text_stream import NO_TEXT


def test_cache_slots_match_the_per_position_formula() -> None:
    rng = random.Random(0)
    for block_size in (1, 2, 16):
        for _ in range(200):
            table = rng.sample(range(1, 500), 40)
            start = rng.randrange(0, 40 * block_size)
            end = rng.randrange(start, 40 * block_size + 1)
            want = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            assert cache_slots(table, start, end, block_size) == want


def test_tokens_between_matches_token_at() -> None:
    rng = random.Random(1)
    seq = Sequence("r", list(range(100, 137)), SamplingParams(max_tokens=64), lambda out: None, NO_TEXT)
    seq.output_token_ids.extend(range(900, 920))
    total = len(seq.prompt_token_ids) + len(seq.output_token_ids)
    for _ in range(300):
        start = rng.randrange(0, total + 1)
        end = rng.randrange(start, total + 1)
        assert seq.tokens_between(start, end) == [seq.token_at(i) for i in range(start, end)]
