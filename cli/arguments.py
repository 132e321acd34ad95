"""Arguments several commands share."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mopd.base.errors import ConfigError
from mopd.base.fsio import store_location

OVERRIDES_HELP = """
KEY=VALUE after CONFIG sets a key of the config for this command, as if written in the file (a path
typed here is relative to the working directory): train.steps=50, train.optim.lr=3e-5,
train.report_to=tensorboard, 'teachers.math=ckpts/math-v2'. Every key, with its default and meaning,
is in docs/config.md; a mistyped key is named with the closest one.
"""


def config_argument(command: Callable[..., Any]) -> Callable[..., Any]:
    """CONFIG, then any number of `key.path=value` overrides of it (`config/overrides.py`), passed to the
    command as `config_path` and `overrides`; the command's help says how to write them."""
    command.__doc__ = inspect.cleandoc(command.__doc__ or "") + "\n" + OVERRIDES_HELP
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
