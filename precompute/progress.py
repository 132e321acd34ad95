"""The precompute progress bar: rows, tokens, tokens/s and ETA, on stderr.

On a terminal it is a live bar. Anywhere else (a batch job's log file, a pipe) a live bar prints
nothing until it ends, so a plain line says the same every `LOG_EVERY_S` seconds instead.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

# Seconds between progress lines when stderr is not a terminal.
LOG_EVERY_S = 30.0


class TokenProgress:
    """Counts rows and tokens against a known total; silent when `enabled` is False."""

    def __init__(self, *, total_rows: int, total_tokens: int, enabled: bool = True) -> None:
        self.total_rows = total_rows
        self.rows = 0
        self.tokens = 0
        self._start = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("job: {task.fields[rows]}/{task.fields[total_rows]} rows"),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
            TextColumn("{task.fields[rate]:,.0f} tok/s"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._enabled = enabled
        self._lines = enabled and not self._progress.console.is_terminal
        self._total_tokens = total_tokens
        self._logged = self._start
        self._description = "precompute"
        self._task = self._progress.add_task(
            self._description, total=max(1, total_tokens), rows=0, total_rows=total_rows, rate=0.0
        )

    def describe(self, text: str) -> None:
        """What runs now (a teacher); the counts stay the job's, over every teacher."""
        self._description = text
        self._progress.update(self._task, description=text)

    def advance(self, *, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        rate = self.tokens / max(1e-9, time.perf_counter() - self._start)
        self._progress.update(self._task, advance=tokens, rows=self.rows, rate=rate)
        now = time.perf_counter()
        if self._lines and now - self._logged >= LOG_EVERY_S:
            self._logged = now
            self._log_line(rate)

    def _log_line(self, rate: float) -> None:
        left = max(0, self._total_tokens - self.tokens) / max(rate, 1e-9)
        sys.stderr.write(
            f"precompute, {self._description}; job: {self.rows:,}/{self.total_rows:,} rows, "
            f"{self.tokens:,}/{self._total_tokens:,} tokens, {rate:,.0f} tok/s, {left / 60:.1f} min left\n"
        )
        sys.stderr.flush()

    def __enter__(self) -> TokenProgress:
        if self._enabled:  # a disabled rich Progress still ends the line it never drew (rich 13.8)
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._enabled:
            self._progress.stop()
