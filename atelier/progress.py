"""Progress bars for long commands: on stderr (stdout stays machine-readable), off with `--quiet`.

A long command takes `-q/--quiet` and `--json` from `output_flags()` and uses the bar the same way:

    with progress(args.quiet or args.json) as bar:
        task = bar.add_task("auditing", total=len(keys))
        for key in keys:
            ...
            bar.advance(task)
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, Task,
                           TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.text import Text

stderr = Console(stderr=True)


class RateColumn(ProgressColumn):
    """Items per second."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:.1f}/s" if task.speed else "-/s")


@contextmanager
def progress(quiet: bool = False, transfer: bool = False) -> Iterator[Progress]:
    """A Progress on stderr with the rate (bytes/s when `transfer`) and the ETA; nothing when quiet."""
    count = [TransferSpeedColumn()] if transfer else [MofNCompleteColumn(), RateColumn()]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), *count,
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=stderr,
                  disable=quiet) as bar:
        yield bar


def output_flags() -> argparse.ArgumentParser:
    """`-q/--quiet` and `--json` for a long command (`parents=[output_flags()]`). Left out, they
    keep the top-level values: a subcommand's own defaults would overwrite `atelier -q upload`."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="no progress bar (it goes to stderr)")
    flags.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="one JSON object on stdout, and no progress bar")
    return flags
