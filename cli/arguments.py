"""Arguments several commands share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def config_argument(command: Callable[..., Any]) -> Callable[..., Any]:
    """CONFIG, then any number of `key.path=value` overrides of it (`config/overrides.py`), passed to the
    command as `config_path` and `overrides`."""
    command = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")(command)
    return click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))(command)
