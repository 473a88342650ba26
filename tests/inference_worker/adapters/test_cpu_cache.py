"""The CPU tier's eviction order: least recently used first, under a count and a byte budget;
entries queued requests wait for (`keep`) only once nothing else is left, themselves LRU first;
checked against the rule written out plainly, over random traffic."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from loraserve.inference_worker.adapters.cpu_cache import CpuCache
from loraserve.inference_worker.lora.payload import AdapterPayload


def payload(i: int, nbytes: int) -> AdapterPayload:
    return AdapterPayload(f"a{i}", "d", 8, torch.zeros(nbytes, dtype=torch.uint8), [])


def expected_put(
    entries: OrderedDict[str, int], key: str, size: int, keep, max_n: int, max_b: int
) -> list[str]:
    """The rule: insert as most recent; then, while over a budget, the LRU entry not kept goes,
    and once none is left, the LRU kept one."""
    entries.pop(key, None)
    entries[key] = size
    order = [k for k in entries if not keep(k)] + [k for k in entries if keep(k)]
    evicted = []
    for k in order:
        if len(entries) <= max_n and sum(entries.values()) <= max_b:
            break
        del entries[k]
        evicted.append(k)
    return evicted


@pytest.mark.parametrize("seed", range(5))
def test_eviction_order_matches_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    max_n, max_b = 8, 5000
    cache, model = CpuCache(max_n, max_b), OrderedDict()
    sizes = {i: rng.randint(100, 1500) for i in range(30)}
    for _ in range(400):
        i = rng.randrange(30)
        if rng.random() < 0.3 and f"a{i}@d" in cache:
            cache.get(f"a{i}@d")
            model.move_to_end(f"a{i}@d")
            continue
        wanted = {f"a{j}@d" for j in rng.sample(range(30), rng.randint(0, 12))}
        got = cache.put(payload(i, sizes[i]), keep=wanted.__contains__)
        assert got == expected_put(model, f"a{i}@d", sizes[i], wanted.__contains__, max_n, max_b)
        assert cache.keys() == list(model) and cache.nbytes == sum(model.values())
        assert len(cache) <= max_n and cache.nbytes <= max_b


def test_a_payload_over_the_byte_budget_is_refused() -> None:
    cache = CpuCache(4, 1000)
    cache.put(payload(1, 400))
    with pytest.raises(ValueError, match="over the CPU cache budget"):
        cache.put(payload(2, 1001))
    assert cache.keys() == ["a1@d"]
