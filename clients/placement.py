"""Where an adapter lives in a fleet when no worker holds it yet: rendezvous (highest random
weight) hashing of the adapter id over the workers' placement keys (their advertised addresses).

    weight(a, w) = first 8 bytes of sha256(a \\0 w), big-endian
    home(a, W)   = argmax over w in W of weight(a, w)

Every worker and every router computes the same home from the same set of keys, with no
coordination: the router sends a request for an adapter held nowhere to its home, and the home
is the one worker that prefetches it. Adding or removing a worker moves only the adapters whose
home it is (1/N of them), and homes spread evenly over the workers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(adapter_id: str, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{adapter_id}\0{key}".encode()).digest()[:8], "big")


def rendezvous_order(adapter_id: str, keys: Iterable[str]) -> list[str]:
    """`keys` from the adapter's home to its last choice (ties, if any, by key)."""
    return sorted(keys, key=lambda k: (-weight(adapter_id, k), k))


def home(adapter_id: str, keys: Iterable[str]) -> str:
    """The adapter's home among `keys` (not empty)."""
    return max(keys, key=lambda k: (weight(adapter_id, k), k))
