"""Progress of long work on stderr: a tqdm bar on a terminal, silent with --quiet.

A run's progress (`RunProgress`) also reaches a log: where stderr is not a terminal (nohup, a
scheduler, a pipe) it prints a line every LINE_INTERVAL_S seconds, so that a long job shows it is
alive, how fast it goes and when it will end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from hrm.units import format_duration

T = TypeVar("T")

LINE_INTERVAL_S = 30.0  # between a run's progress lines where stderr is not a terminal


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


class RunProgress:
    """A run's requests and tokens: a bar on a terminal, else a line every LINE_INTERVAL_S (at
    the first step after it: a step is never cut), nothing with quiet.

    tokens: the most the run can make (each request's max_tokens), against which the ETA is
    reckoned; a request that stops early gives up the rest of its share (`batch_done`)."""

    def __init__(self, *, tokens: int, requests: int, quiet: bool,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.tokens, self.requests = tokens, requests
        self.made = 0  # tokens generated
        self.counted = 0  # of `tokens`, those made or given up by a request that stopped early
        self.done = 0  # requests finished
        self._batch_start = 0  # `counted` when the current batch began
        self._clock = clock
        self._start = self._last = clock()
        self._lines = not quiet and not sys.stderr.isatty()
        self._bar = None
        if show_progress(quiet):
            from tqdm import tqdm

            self._bar = tqdm(total=tokens, desc="prefill", unit="tok", leave=False)

    def step(self, phase: str, tokens: int) -> None:
        """A generation step of `phase` ("prefill", "decode") made `tokens` tokens."""
        self.made += tokens
        self._advance(tokens, phase)

    def batch_done(self, requests: int, budget: int) -> None:
        """A batch of `requests` ended; `budget`: the tokens it could make at most."""
        self.done += requests
        self._advance(self._batch_start + budget - self.counted, None)
        self._batch_start = self.counted

    def request_done(self, made: int, most: int) -> None:
        """A request of continuous batching ended after `made` of its `most` tokens."""
        self.done += 1
        self._advance(most - made, None)

    def line(self) -> str:
        """Requests done, tokens, the rate of generated tokens, the ETA of the whole run."""
        elapsed = self._clock() - self._start
        rate = self.made / elapsed if elapsed > 0 else 0.0
        left = self.tokens - self.counted
        eta = format_duration(left * elapsed / self.counted) if self.counted else "unknown"
        return (
            f"progress: {self.done}/{self.requests} requests done, {self.made} tokens "
            f"(at most {self.tokens}), {rate:.1f} tok/s, ETA {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _advance(self, counted: int, phase: str | None) -> None:
        self.counted += counted
        if self._bar is not None:
            if phase is not None:
                self._bar.set_description(phase, refresh=False)
            self._bar.set_postfix_str(f"{self.done}/{self.requests} requests", refresh=False)
            self._bar.update(counted)
        elif self._lines and self._clock() - self._last >= LINE_INTERVAL_S:
            self._last = self._clock()
            print(self.line(), file=sys.stderr, flush=True)
