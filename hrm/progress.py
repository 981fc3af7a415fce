"""Progress bars for long work: shown on a terminal, silent with --quiet or when not a TTY."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def progress(
    iterable: Iterable[T], *, desc: str, quiet: bool, total: int | None = None
) -> Iterable[T]:
    """Wrap `iterable` in a tqdm bar on stderr when a person is watching."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not show_progress(quiet), leave=False)


def progress_bar(*, total: int, desc: str, quiet: bool, unit: str = "it"):
    """A tqdm bar to advance by hand (bar.update()) when the work is not one loop; its rate is
    in `unit`s a second, its ETA for the whole total."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not show_progress(quiet), leave=False)
