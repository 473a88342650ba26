"""Bounded label values for per-adapter metrics: the `k` most used adapters get their own label,
every other one is counted under "other", so a fleet with thousands of adapters exports at most
k + 1 series per metric and label combination.

Use is counted approximately, in bounded memory: at most `max_tracked` adapters are counted
(past that the least used half of the unlabelled ones is forgotten, as in the Space-Saving
family of heavy-hitter counters), and every count halves each `half_life` uses, so the ranking
follows recent traffic. An adapter takes over a label from the least used labelled one once it
has been used twice as much (hysteresis, so two adapters of equal use do not swap at each
request); `on_demote` is called with the one that lost its label, so its series can be removed.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

OTHER = "other"


class TopLabels:
    def __init__(
        self,
        k: int,
        on_demote: Callable[[str], None] | None = None,
        *,
        max_tracked: int | None = None,
        half_life: int = 100_000,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.max_tracked = max_tracked if max_tracked is not None else max(1024, 8 * k)
        self._half_life = half_life
        self._on_demote = on_demote
        self._counts: dict[str, float] = {}
        self._labelled: set[str] = set()
        self._floor = 0.0  # a lower bound of the smallest count among the labelled
        self._uses = 0
        self._lock = threading.Lock()

    def label(self, key: str, weight: float = 1.0) -> str:
        """Count one use of `key`; the label value its samples go under now."""
        with self._lock:
            demoted = self._use(key, weight)
            label = key if key in self._labelled else OTHER
        if demoted is not None and self._on_demote is not None:
            self._on_demote(demoted)
        return label

    def peek(self, key: str) -> str:
        """The label value of `key`, counting no use."""
        with self._lock:
            return key if key in self._labelled else OTHER

    @property
    def labelled(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._labelled)

    @property
    def num_tracked(self) -> int:
        return len(self._counts)

    def _use(self, key: str, weight: float) -> str | None:
        """Count, maybe promote `key`; the key that lost its label, if one did."""
        self._uses += 1
        if self._uses % self._half_life == 0:
            self._counts = {k: c / 2 for k, c in self._counts.items()}
            self._floor /= 2
        if key not in self._counts and len(self._counts) >= self.max_tracked:
            self._forget_least_used()
        count = self._counts[key] = self._counts.get(key, 0.0) + weight
        if key in self._labelled or key == OTHER:
            return None
        if len(self._labelled) < self.k:
            self._labelled.add(key)
            return None
        if count <= 2 * self._floor:
            return None
        weakest = min(self._labelled, key=lambda k: self._counts.get(k, 0.0))
        self._floor = self._counts.get(weakest, 0.0)
        if count <= 2 * self._floor:
            return None
        self._labelled.discard(weakest)
        self._labelled.add(key)
        self._floor = min(self._counts.get(k, 0.0) for k in self._labelled)
        return weakest

    def _forget_least_used(self) -> None:
        unlabelled = sorted((c, k) for k, c in self._counts.items() if k not in self._labelled)
        for _, k in unlabelled[: len(unlabelled) // 2 + 1]:
            del self._counts[k]
