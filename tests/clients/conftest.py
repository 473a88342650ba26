"""The store fixtures (adapter roots, running stores) are shared with the client tests."""

from tests.adapter_store.conftest import (  # noqa: F401 - fixtures
    adapter_root,
    base_config,
    make_demo,
    peft_root,
    start_store,
    store,
    store_config,
    stub,
)
