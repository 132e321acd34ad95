"""The files and folders a command reads from its config, checked before anything heavy loads: every
missing one is named at once, with its key and the path it resolved to, never one per run."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

from mopd.base.errors import ConfigError
from mopd.base.fsio import object_url
from mopd.config.mopd_config import MopdConfig

# What each command reads. `teachers` is every alias's checkpoint; `mopd train` reads only their heads,
# which the store holds, so there a teacher may be absent where it is the checkpoint the store records.
PRECOMPUTE = ("tokenizer", "teachers", "data.path")
TRAIN = ("teachers", "train.student", "train.init_from")
ROLLOUT = ("tokenizer", "train.student", "rollout.prompts")
ROUNDS = (
    "tokenizer",
    "teachers",
    "train.student",
    "train.init_from",
    "rollout.prompts",
    "rounds.heldout_prompts",
)


def rounds_paths(config: MopdConfig) -> tuple[str, ...]:
    """What `mopd rounds` reads: data.path too where rounds.off_policy_fraction mixes its rows in."""
    mixed = config.rounds is not None and config.rounds.off_policy_fraction > 0
    return (*ROUNDS, "data.path") if mixed else ROUNDS


def configured_paths(config: MopdConfig, keys: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(dotted key, value) of each of `keys` the config sets; `teachers` gives one per alias."""
    train, rollout, rounds = config.train, config.rollout, config.rounds
    init = train.init_from.checkpoint if train is not None and train.init_from is not None else None
    values = {
        "tokenizer": config.tokenizer,
        "data.path": config.data.path,
        "train.student": train.student if train is not None else None,
        "train.init_from": init,
        "rollout.prompts": rollout.prompts if rollout is not None else None,
        "rounds.heldout_prompts": rounds.heldout_prompts if rounds is not None else None,
    }
    for key in keys:
        if key == "teachers":
            yield from ((f"teachers.{alias}", path) for alias, path in config.teachers.items())
        elif (value := values[key]) is not None:
            yield key, value


def missing_paths(
    config: MopdConfig, keys: Iterable[str], *, recorded: Collection[str] = ()
) -> list[tuple[str, str]]:
    """(key, resolved path) of each of `keys` whose file or folder is not there; `recorded`: teacher
    checkpoints a store names, which may be absent from this machine."""
    missing = []
    for key, value in configured_paths(config, keys):
        if object_url(value) or (key.startswith("teachers.") and value in recorded):
            continue
        path = Path(config.folder) / Path(value).expanduser()  # an absolute value stays itself
        if not path.exists():
            missing.append((key, str(path)))
    return missing


def teachers_as_found(config: MopdConfig, recorded: Collection[str] = ()) -> dict[str, str]:
    """The config's teachers (alias → checkpoint), each missing one (`missing_paths`) as the path it
    resolved to: what a comparison with a store names."""
    missing = dict(missing_paths(config, ("teachers",), recorded=recorded))
    return {alias: missing.get(f"teachers.{alias}", path) for alias, path in config.teachers.items()}


def check_paths(
    config: MopdConfig,
    keys: Iterable[str],
    *,
    recorded: Collection[str] = (),
    also: Sequence[tuple[str, str]] = (),
) -> None:
    """Refuses, in one line naming every missing path with its key, a config whose `keys` name files or
    folders that are not there (`also`: (key, path) of more the caller found missing).

    Raises:
        ConfigError: one or more paths are missing.
    """
    missing = [*also, *missing_paths(config, keys, recorded=recorded)]
    if not missing:
        return
    listed = "; ".join(f"{key}: {path}" for key, path in missing)
    what = "a path that does not exist" if len(missing) == 1 else f"{len(missing)} paths that do not exist"
    raise ConfigError(
        f"{config.source} names {what} — {listed} (paths in the file are relative to its folder, "
        f"{config.folder}; mopd reads local checkpoints only): correct the config or create them"
    )
