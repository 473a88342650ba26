"""The step plan's lists built by slices, runs and kept rows (model_runner.cache_slots,
Sequence.tokens_between, table_rows.TableRows) equal their one-at-a-time definitions."""

from __future__ import annotations

import random

from loraserve.inference_worker.engine.model_runner import cache_slots
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.table_rows import TableRows
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


def _flat(head: list[int], tables: list[list[int]], width: int) -> list[int]:
    out = list(head)
    for t in tables:
        out += t + [0] * (width - len(t))
    return out


def test_table_rows_follow_tables_that_grow_or_are_replaced() -> None:
    """Over random steps (tables grown in place, replaced by new lists, sequences leaving and
    coming back, padding rows) the packed buffer always equals the tables flattened anew."""
    rng = random.Random(2)
    rows = TableRows()
    tables: dict[int, list[int]] = {k: [] for k in range(12)}
    for _ in range(400):
        for key, table in tables.items():
            what = rng.random()
            if what < 0.3:
                table.extend(rng.randrange(1, 10_000) for _ in range(rng.randrange(1, 4)))
            elif what < 0.35:  # freed or preempted: a new list, maybe refilled
                tables[key] = [rng.randrange(1, 10_000) for _ in range(rng.randrange(0, 5))]
            elif what < 0.38:  # forked: a copy of a prefix, then its own block
                parent = tables[rng.randrange(12)]
                tables[key] = parent[: rng.randrange(0, len(parent) + 1)] + [rng.randrange(1, 10_000)]
        step = [k for k in tables if tables[k] and rng.random() < 0.8]
        keys: list[int | None] = [*step, *([None] * rng.randrange(0, 3))]
        step_tables = [tables[k] if k is not None else [0] for k in keys]
        if not step_tables:
            continue
        width = max(len(t) for t in step_tables)
        head = [rng.randrange(0, 100) for _ in range(rng.randrange(1, 6))]
        assert rows.pack(head, keys, step_tables, width).tolist() == _flat(head, step_tables, width)
