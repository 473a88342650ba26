"""Summarize py-spy's raw (collapsed) profiles of the worker, as bench_serving.py --profile writes
them: each thread's share of the samples, and for one thread the functions its samples were in
(inclusive: a function counts once per sample wherever it is on the stack).

    python benchmarks/profile_summary.py DIR/n1000-saturation.txt [--thread engine] [--top 25]

A profile taken with --idle counts a thread's waiting samples too (lock and condition waits show
as their Python frames); a --gil profile (name.gil.txt) holds only the thread with the lock."""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# py-spy's raw lines: "frame;frame;...;frame COUNT", threads as "thread (0x..)" or a name frame
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def read(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.append((m["stack"].split(";"), int(m["count"])))
    return out


def thread_of(stack: list[str]) -> str:
    for frame in stack[:2]:
        if frame.startswith("thread"):
            return frame
    return stack[0] if stack else "?"


def function(frame: str) -> str:
    """'step (loraserve/inference_worker/engine/engine.py:262)' -> 'step (engine.py)'."""
    name, _, where = frame.partition(" (")
    file = where.split(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", nargs="+", type=Path)
    p.add_argument("--thread", default="engine", help="the thread to break down (a part of its name)")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    for path in a.profiles:
        samples = read(path)
        total = sum(c for _, c in samples) or 1
        threads: collections.Counter[str] = collections.Counter()
        for stack, c in samples:
            threads[thread_of(stack)] += c
        print(f"== {path.name}: {total} samples")
        for name, c in threads.most_common(12):
            print(f"  {100 * c / total:6.1f} %  {name}")
        want = a.thread
        inclusive: collections.Counter[str] = collections.Counter()
        n = 0
        for stack, c in samples:
            if want not in thread_of(stack):
                continue
            n += c
            for f in {function(f) for f in stack[1:]}:
                inclusive[f] += c
        print(f"  -- {want!r}: {n} samples; functions by inclusive share")
        for f, c in inclusive.most_common(a.top):
            print(f"  {100 * c / max(n, 1):6.1f} %  {f}")


if __name__ == "__main__":
    main()
