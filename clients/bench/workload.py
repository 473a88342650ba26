"""The request stream of a benchmark: when each request arrives, which adapter it names, its prompt
and how many tokens it asks for. Everything is drawn from seeded generators, one per aspect, so a
seed reproduces the stream and changing, say, the rate leaves the adapter sequence as it was.

Adapter popularity over N ids: uniform, or Zipf (P(rank k) ∝ 1 / k^s, rank 1 = the first id), with a
share of requests for the base model (adapter id ""). Arrivals: a Poisson process at `rate` requests
per second (exponential gaps), or all at time 0 when a closed loop of fixed concurrency paces them.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

POPULARITIES = ("uniform", "zipf")


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a prompt file: text, and the output length it asks for (None: draw one)."""

    text: str
    max_tokens: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    adapter_ids: tuple[str, ...] = ()  # the N adapters, most popular first under Zipf
    popularity: str = "uniform"
    zipf_exponent: float = 1.0
    base_share: float = 0.0  # share of requests for the base model
    prompt_len: tuple[int, int] = (32, 32)  # tokens, inclusive range (synthetic prompts)
    output_len: tuple[int, int] = (32, 32)  # max_tokens, inclusive range
    prompts: tuple[PromptSpec, ...] = ()  # when set, prompts are drawn from these instead
    vocab_size: int = 32000  # synthetic prompt tokens are drawn from [0, vocab_size)
    rate: float | None = None  # Poisson arrivals per second; None: every request at time 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.popularity not in POPULARITIES:
            raise ValueError(f"popularity must be one of {POPULARITIES}, not {self.popularity!r}")
        if self.popularity == "zipf" and not self.zipf_exponent >= 0:
            raise ValueError(f"zipf exponent must be >= 0, got {self.zipf_exponent}")
        if not 0.0 <= self.base_share <= 1.0:
            raise ValueError(f"base share must be in [0, 1], got {self.base_share}")
        if not self.adapter_ids and self.base_share < 1.0:
            raise ValueError("no adapter ids: set a base share of 1 or name some adapters")
        if len(set(self.adapter_ids)) != len(self.adapter_ids):
            raise ValueError("adapter ids must be distinct")
        for name, (lo, hi) in (("prompt length", self.prompt_len), ("output length", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {lo}..{hi}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab size must be >= 1, got {self.vocab_size}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number of requests per second, got {self.rate}")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float  # offset from the start of the run
    adapter_id: str  # "" = base model
    prompt: str | list[int] = field(repr=False)  # text from a prompt file, else token ids
    max_tokens: int = 0

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when known before tokenizing (synthetic prompts)."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Unnormalized Zipf weights of ranks 1..n: 1 / k^exponent."""
    return [1.0 / (k**exponent) for k in range(1, n + 1)]


def adapter_ids(count: int, id_format: str = "adapter-{i:04d}") -> tuple[str, ...]:
    """`count` ids from a format with field `i` (0-based), e.g. adapter-0000 .. adapter-0999."""
    if count < 0:
        raise ValueError(f"adapter count must be >= 0, got {count}")
    ids = tuple(id_format.format(i=i) for i in range(count))
    if len(set(ids)) != len(ids):
        raise ValueError(f"adapter id format {id_format!r} does not make distinct ids (use {{i}})")
    return ids


def load_prompts(path: str | Path) -> tuple[PromptSpec, ...]:
    """A JSONL prompt file: each line a JSON string, or an object with "prompt" (text) and optionally
    "max_tokens" (or "output_len"). Blank lines are skipped."""
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON: {exc.msg}") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'{path}:{n}: expected a string or an object with a non-empty "prompt"')
        out = item.get("max_tokens", item.get("output_len"))
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
            raise ValueError(f"{path}:{n}: max_tokens must be a positive integer, got {out!r}")
        prompts.append(PromptSpec(item["prompt"], out))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return tuple(prompts)


class RequestStream:
    """An endless, reproducible stream of BenchRequests: every iteration starts the same sequence
    again; `take(n)` for the first n."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        n = len(spec.adapter_ids)
        weights = zipf_weights(n, spec.zipf_exponent) if spec.popularity == "zipf" else [1.0] * n
        self._cum_weights = list(itertools.accumulate(weights))

    def __iter__(self) -> Iterator[BenchRequest]:
        spec, seed = self.spec, self.spec.seed
        # one generator per aspect (string seeds are hashed with sha512: stable across runs)
        arrivals = random.Random(f"{seed}:arrivals")
        adapters = random.Random(f"{seed}:adapters")
        lengths = random.Random(f"{seed}:lengths")
        tokens = random.Random(f"{seed}:tokens")
        ids, cum = spec.adapter_ids, self._cum_weights
        total = cum[-1] if cum else 0.0
        t = 0.0
        for i in itertools.count():
            if spec.rate is not None:
                t += arrivals.expovariate(spec.rate)
            # both draws always happen so the adapter sequence depends on the seed alone
            u, pick = adapters.random(), adapters.random()
            adapter = "" if u < spec.base_share or not ids else ids[_index(cum, pick * total)]
            max_tokens = lengths.randint(*spec.output_len)
            prompt: str | list[int]
            if spec.prompts:
                p = spec.prompts[lengths.randrange(len(spec.prompts))]
                prompt, max_tokens = p.text, p.max_tokens or max_tokens
            else:
                n = lengths.randint(*spec.prompt_len)
                prompt = _random_tokens(tokens, n, spec.vocab_size)
            yield BenchRequest(i, t, adapter, prompt, max_tokens)

    def take(self, n: int) -> list[BenchRequest]:
        return list(itertools.islice(iter(self), n))


_U32 = next(t for t in "IL" if array(t).itemsize == 4)


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n tokens in [0, vocab_size) from 4 random bytes each (little-endian on any machine, so a seed
    gives the same prompts everywhere; the modulo's bias is below vocab_size / 2^32)."""
    words = array(_U32, rng.randbytes(4 * n))
    if sys.byteorder == "big":
        words.byteswap()
    return [w % vocab_size for w in words]


def _index(cum: Sequence[float], x: float) -> int:
    """First index whose cumulative weight exceeds x (clamped: float rounding at the top end)."""
    return min(bisect.bisect_right(cum, x), len(cum) - 1)
