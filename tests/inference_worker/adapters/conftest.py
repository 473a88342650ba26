"""The pool harness of the adapter tests: a pool against the real store, closed at teardown."""

from __future__ import annotations

import pytest

from tests.helpers.pool_harness import Harness


@pytest.fixture
def harness(tiny_model_dir, lora_store):
    made: list[Harness] = []

    def make(**kw) -> Harness:
        h = Harness(tiny_model_dir, lora_store.address, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
