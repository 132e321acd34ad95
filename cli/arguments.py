"""Arguments several commands share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mopd.base.errors import ConfigError
from mopd.base.fsio import store_location


def config_argument(command: Callable[..., Any]) -> Callable[..., Any]:
    """CONFIG, then any number of `key.path=value` overrides of it (`config/overrides.py`), passed to the
    command as `config_path` and `overrides`."""
    command = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")(command)
    return click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))(command)


class StoreLocation(click.ParamType):
    """A store's location: a path, a file:// URL or an object-storage URL (`base.fsio.store_location`);
    other URLs are refused with the reason."""

    name = "store"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return store_location(value, what=param.human_readable_name if param else "store")
        except ConfigError as err:
            self.fail(str(err), param, ctx)


STORE = StoreLocation()
