"""The one YAML config file: `MopdConfig` composes the sections each part of mopd reads.

Unknown keys are errors, and every error names the dotted key the user wrote. Relative paths are
resolved against the folder that holds the config file, so a config means the same thing from any
working directory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from mopd.base.errors import ConfigError
from mopd.base.fsio import object_url, store_location
from mopd.base.jsonio import check_unicode, decode_text
from mopd.base.section import NonEmpty, Section
from mopd.config.explain import explain
from mopd.config.overrides import apply_overrides, parse_override
from mopd.config.precompute import DataConfig, PrecomputeConfig, RoutingConfig, alias_list
from mopd.config.rollout import RolloutConfig, RoundsConfig
from mopd.config.store import StoreConfig
from mopd.config.train import TrainConfig


class MopdConfig(Section):
    tokenizer: NonEmpty | None = None
    teachers: dict[str, NonEmpty] = Field(min_length=1)
    routing: RoutingConfig = RoutingConfig()
    data: DataConfig
    store: StoreConfig = StoreConfig()
    precompute: PrecomputeConfig = PrecomputeConfig()
    train: TrainConfig | None = None
    rollout: RolloutConfig | None = None
    rounds: RoundsConfig | None = None
    # The folder relative paths were resolved against (`parse_config`'s base_dir): where a checkpoint
    # kept as an identifier would be, were it a folder.
    _folder: str = PrivateAttr(default=".")
    _source: str = PrivateAttr(default="the config")  # the file it was read from, to name in errors

    def __eq__(self, other: object) -> bool:
        """Equal settings are equal configs, wherever each was read from."""
        if not isinstance(other, MopdConfig):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in type(self).model_fields)

    @property
    def folder(self) -> str:
        return self._folder

    @property
    def source(self) -> str:
        return self._source

    @model_validator(mode="after")
    def _aliases_exist(self) -> MopdConfig:
        aliases = set(self.teachers)
        routes = {f"teacher_by_agent.{agent}": a for agent, a in self.routing.teacher_by_agent.items()}
        if self.routing.default_teacher is not None:
            routes["default_teacher"] = self.routing.default_teacher
        for key, value in routes.items():
            for alias in alias_list(value):
                if alias not in aliases:
                    raise ValueError(
                        f"routing.{key}: alias {alias!r} is not in teachers ({', '.join(sorted(aliases))})"
                    )
        if self.train is not None:
            weights = self.train.teacher_weights
            for alias, weight in weights.items():
                if alias not in aliases:
                    raise ValueError(f"train.teacher_weights.{alias}: not an alias in teachers")
                if weight < 0:
                    raise ValueError(f"train.teacher_weights.{alias}: {weight} is negative; weights are ≥ 0")
            if (
                all(weights.get(alias, 1.0) == 0 for alias in aliases)
                and self.train.divergence.ce_weight == 0
            ):
                raise ValueError(
                    "train.teacher_weights: every teacher's weight is 0 (and ce_weight is 0), so the loss is "
                    "0 and nothing would train; give at least one teacher a positive weight"
                )
        return self

    @model_validator(mode="after")
    def _rounds_have_what_they_run(self) -> MopdConfig:
        if self.rounds is not None and (self.rollout is None or self.train is None):
            missing = " and ".join(s for s in ("rollout", "train") if getattr(self, s) is None)
            raise ValueError(
                f"rounds: each round samples (rollout) and trains (train); add the {missing} section"
            )
        return self

    def agent_to_alias(self) -> dict[str, str | list[str]]:
        """The routing table: explicit `teacher_by_agent` (an alias or a list of them per agent), else
        each alias routes its own name."""
        return dict(self.routing.teacher_by_agent) or {alias: alias for alias in self.teachers}


MAX_CONFIG_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one) and aliases
    (`*name`: a few nested ones expand to billions of nodes, and a mopd config never needs one)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(
                f"YAML alias at line {mark.line + 1}: aliases (*name) are not allowed in a config"
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str | int | float | bool) and key is not None:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: a mapping key must be a plain name")
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                f"(first at line {seen[key] + 1}); each key may appear once"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 reads `1e-4` (an exponent without a dot) as text; YAML 1.2, and every config author, as a
# number. Numbers are never read from text (`base/section.py`), so the loader reads them as 1.2 does.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: str | Path) -> Any:
    """Parses a YAML file safely; duplicate keys raise `ConfigError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    return parse_yaml(data, source=str(path))


def parse_yaml(data: bytes, *, source: str = "config") -> Any:
    """Parses YAML text safely.

    Raises:
        ConfigError: oversized, not UTF-8, not YAML, duplicate keys, aliases, or nested too deep.
    """
    text = decode_text(data, what=source, error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from err
    except RecursionError as err:
        raise ConfigError(f"{source}: nested too deeply to be a config") from err
    check_unicode(value, what=source, error=ConfigError)
    return value


def _resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    def as_path(value: str) -> str:
        if not value:
            return value  # refused by the field: an empty path would name the config's own folder
        path = base / Path(value).expanduser()
        try:
            return str(path.resolve())
        except (OSError, ValueError):  # not a name this filesystem could hold: reading it will say so
            return str(path)

    def as_store(value: str) -> str:
        if not value:
            return value  # refused by the field, as in as_path
        try:
            location = store_location(value, what="store.path")
        except ConfigError:
            return value  # refused by the field, which says why
        return location if object_url(location) else as_path(location)

    def exists(value: str) -> bool:
        try:
            return (base / value).exists()
        except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte: not a folder
            return False

    def as_checkpoint(value: str) -> str:
        # A checkpoint is a local folder when it exists or is written as a path; anything else
        # (e.g. "org/model") is kept as an identifier and normalised by `normalise_checkpoint`.
        looks_like_path = value.startswith((".", "/", "~")) or (value != "" and exists(value))
        return as_path(value) if looks_like_path else value

    out = dict(raw)
    if isinstance(out.get("teachers"), dict):
        out["teachers"] = {
            alias: as_checkpoint(ckpt) if isinstance(ckpt, str) else ckpt
            for alias, ckpt in out["teachers"].items()
        }
    if isinstance(out.get("tokenizer"), str):
        out["tokenizer"] = as_checkpoint(out["tokenizer"])
    for section, key, resolve in (
        ("data", "path", as_path),
        ("store", "path", as_store),
        ("train", "student", as_checkpoint),
        ("train", "output_dir", as_path),
        ("rollout", "prompts", as_path),
        ("rollout", "output", as_path),
        ("rounds", "workdir", as_path),
        ("rounds", "heldout_prompts", as_path),
    ):
        block = out.get(section)
        if isinstance(block, dict) and isinstance(block.get(key), str):
            out[section] = {**block, key: resolve(block[key])}
    train = out.get("train")
    if not isinstance(train, dict):
        return out
    init = train.get("init_from")
    if isinstance(init, str):
        out["train"] = {**train, "init_from": as_path(init)}
    elif isinstance(init, dict) and isinstance(init.get("checkpoint"), str):
        out["train"] = {**train, "init_from": {**init, "checkpoint": as_path(init["checkpoint"])}}
    return out


def parse_config(
    raw: Any, *, base_dir: str | Path, source: str = "config", overrides: Mapping[str, str] | None = None
) -> MopdConfig:
    """Validates a parsed YAML document; relative paths resolve against `base_dir`. `overrides` (dotted
    key → the `key=value` typed) name the command line, not `source`, as the origin of their errors.

    Raises:
        ConfigError: naming every offending key.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, found {type(raw).__name__}")
    try:
        config = MopdConfig.model_validate(_resolve_paths(raw, Path(base_dir)))
    except ValidationError as err:
        raise ConfigError(explain(err, MopdConfig, source=source, overrides=overrides or {})) from err
    config._folder, config._source = str(Path(base_dir).resolve()), source
    return config


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> MopdConfig:
    """Loads and validates a config file, with command-line `overrides` (`key.path=value`, see
    `config/overrides.py`) set before validation.

    Raises:
        ConfigError: the file is unreadable, not YAML, has duplicate keys, an override is malformed, or
            the result fails validation.
    """
    path = Path(path)
    raw = apply_overrides(load_yaml(path), overrides)
    typed = {".".join(parse_override(text)[0]): text for text in overrides}
    return parse_config(raw, base_dir=path.resolve().parent, source=str(path), overrides=typed)


EFFECTIVE_CONFIG_FILE = "config.yaml"  # in a run folder: the config the run last started with


def dump_config(config: MopdConfig) -> str:
    """`config` as YAML that `load_config` reads back to an equal config: every setting that differs from
    its default (the file's and the command line's), paths absolute. (Defaults are left out: some
    settings are refused where they do not apply even at their default value.)"""
    settings = config.model_dump(mode="json", exclude_defaults=True)
    return yaml.safe_dump(settings, sort_keys=False, allow_unicode=True)
