"""Command-line overrides of a config: `mopd train config.yaml train.steps=50 train.optim.lr=3e-5`.

Each override is `dotted.key=value`. The value is read as a YAML value by the config's own parser (so
`50` is an int, `3e-5` a float, `[a, b]` a list, `{tp: 2}` a mapping, anything else text), then set
into the parsed document before validation: the same models check it and name the key when it is
wrong, as for a key written in the file. A relative path given on the command line is relative to the
working directory, as the shell that typed it means it (paths in the file stay relative to the
config's folder).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopd.base.errors import ConfigError

# The config's path-valued keys, as dotted names; checkpoints (`teachers.<alias>` too) may instead be
# identifiers such as `org/model`, kept as written unless they name a folder.
PATH_KEYS = frozenset(
    {
        "data.path",
        "store.path",
        "train.output_dir",
        "train.init_from",
        "train.init_from.checkpoint",
        "rollout.prompts",
        "rollout.output",
        "rounds.workdir",
        "rounds.heldout_prompts",
    }
)
CHECKPOINT_KEYS = frozenset({"train.student", "tokenizer"})


def parse_override(text: str) -> tuple[list[str], Any]:
    """(`key` split at its dots, value) of one `key=value` override.

    Raises:
        ConfigError: no `=`, an empty key or key part, or a value that is not YAML.
    """
    from mopd.config.mopd_config import parse_yaml  # the config's own YAML reader (it imports this)

    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(
            f"override {text!r}: write it as section.key=value (e.g. train.steps=50), the key as dotted names"
        )
    parsed = parse_yaml(value.encode(), source=f"override {key.strip()}") if value.strip() else ""
    return parts, parsed


def apply_overrides(raw: Any, overrides: Sequence[str], *, cwd: Path | None = None) -> Any:
    """`raw` (a parsed config document) with each override set in turn; a later override of a key wins.

    Raises:
        ConfigError: a malformed override, or one whose key runs through a value that is no mapping.
    """
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # refused by the validation, which names the document's type
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        key = ".".join(parts)
        if isinstance(value, str) and value:
            value = _from_working_directory(key, value, Path(cwd or os.getcwd()))
        block = out
        for depth, part in enumerate(parts[:-1]):
            child = block.get(part)
            if child is None:
                child = block[part] = {}
            elif not isinstance(child, dict):
                above = ".".join(parts[: depth + 1])
                raise ConfigError(
                    f"override {key}: {above} is {child!r} in the config, not a section with keys"
                )
            block = child
        block[parts[-1]] = value
    return out


def _from_working_directory(key: str, value: str, cwd: Path) -> str:
    """A path override made absolute against `cwd`; other values as they are."""
    checkpoint = key in CHECKPOINT_KEYS or (key.startswith("teachers.") and key.count(".") == 1)
    if key in PATH_KEYS or (checkpoint and (value.startswith((".", "/", "~")) or (cwd / value).exists())):
        return str(cwd / Path(value).expanduser())
    return value
