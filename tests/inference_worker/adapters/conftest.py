"""The pool harness of the adapter tests: a pool against the real store, closed at teardown; every
test runs with slot loads on the step thread (sync) and on a slot loader's thread (async)."""

from __future__ import annotations

import pytest

from tests.helpers.pool_harness import Harness


@pytest.fixture(params=["sync", "async"])
def harness(request, tiny_model_dir, lora_store):
    made: list[Harness] = []

    def make(**kw) -> Harness:
        kw.setdefault("async_loads", request.param == "async")
        h = Harness(tiny_model_dir, lora_store.address, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
