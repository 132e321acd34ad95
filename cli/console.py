"""The stderr console the commands report on, and a `log` that prints library lines verbatim."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console


def stderr_console() -> Console:
    """Progress and reports on stderr; long log lines are not wrapped at 80 columns when piped."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def plain_log(console: Console) -> Callable[[str], None]:
    """Prints library log lines as they are: `[t0=1.2 t1=3.4]` is text, not rich markup."""
    return lambda line: console.print(line, markup=False)
