"""Before step 1: the store against the config that trains on it.

`mopd train` reads the store, never the teachers or the data the config names, so a config edited after
precompute would otherwise train on the old store in silence. The teachers and the routing are checked
as `verify-manifest --config` checks them, and a difference is refused; data settings that differ (a
`--store` may rightly point a config at another store) are one warning line: the store is what trains.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import MopdConfig
from mopd.config.paths import teachers_as_found
from mopd.store.format.manifest import Manifest
from mopd.store.format.provenance import recorded_source, same_source
from mopd.store.locations.location import Location
from mopd.store.verify import check_teachers
from mopd.tokens.pieces import swapped_tokenizer
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.hf import STUDENT_TOKENIZER_FIX


def store_differences(config: MopdConfig, manifest: Manifest) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the config's teachers, aliases, tokenizers and routing against the
    store's, one line each; the teachers' checkpoints are fingerprinted where they are reachable."""
    teachers = teachers_as_found(config, {t.checkpoint for t in manifest.teachers})
    problems, warnings = check_teachers(manifest, teachers, config.routing.model_dump(mode="json"))
    return with_tokenizers(problems, config, manifest), warnings


def with_tokenizers(teacher_problems: list[str], config: MopdConfig, manifest: Manifest) -> list[str]:
    """`teacher_problems` (`check_config`'s) with each tokenizer swapped since precompute named first: a
    teacher whose tokenizer files changed is a different teacher too, and its tokenizer is the cause, so
    its line replaces the generic one."""
    swapped = tokenizer_differences(config, manifest)
    kept = [p for p in teacher_problems if not any(p.startswith(f"teacher {t} (") for t in swapped)]
    return list(swapped.values()) + kept


def tokenizer_differences(config: MopdConfig, manifest: Manifest) -> dict[int | str, str]:
    """For a store with teachers of other tokenizers (DESIGN §13): each such teacher whose configured
    checkpoint now carries another tokenizer than the one its rows were aligned with (by index), and
    the student if its tokenizer is not the store's (under "student"), one line each."""
    if not manifest.tokenizer.fingerprint:
        return {}
    found: dict[int | str, str] = {}
    for teacher in manifest.teachers:
        alias = next((a for a in teacher.aliases if a in config.teachers), None)
        if teacher.tokenizer is None or alias is None:
            continue
        problem = swapped_tokenizer(
            config.teachers[alias],
            teacher.tokenizer.fingerprint,
            what=f"teachers.{alias}",
            fix="restore its tokenizer files, or precompute a new store with it",
        )
        if problem:
            found[teacher.index] = problem
    if config.train is not None:
        problem = swapped_tokenizer(
            config.train.student,
            manifest.tokenizer.fingerprint,
            what="train.student",
            fix=STUDENT_TOKENIZER_FIX,
        )
        if problem:
            found["student"] = problem
    return found


def data_differences(config: MopdConfig, manifest: Manifest, root: Location) -> list[str]:
    """Each data setting of the config that differs from those the store was built with."""
    data, recorded = config.data, manifest.config.data
    found = []
    if manifest.dataset.source != data.path:
        found.append(f"data.path: {manifest.dataset.source!r} in the store, {data.path!r} in the config")
    else:
        source = recorded_source(root, manifest.dataset.fingerprint)
        if source is not None and not same_source(Path(data.path), source):
            found.append(f"data.path: {data.path} has changed since the store was built from it")
    for key in ("max_length", "overlong") if recorded is not None else ():
        stored, configured = getattr(recorded, key), getattr(data, key)
        if stored != configured:
            found.append(f"data.{key}: {stored!r} in the store, {configured!r} in the config")
    return found


def check_store(
    config: MopdConfig, manifest: Manifest, root: Location, *, world: RankGroup, log: Callable[[str], None]
) -> None:
    """Refuses a store precomputed for other teachers or routing than `config`'s, and warns once of data
    settings that differ. Rank 0 checks (fingerprinting reads every teacher's weights once); every rank
    raises what it found.

    Raises:
        ConfigError: naming each teacher, alias or routing key that differs, with both values.
    """
    found = None
    if world.rank == 0:
        problems, warnings = store_differences(config, manifest)
        found = (problems, warnings, data_differences(config, manifest, root))
    problems, warnings, data = world.broadcast_object(found)
    for warning in warnings:
        log(f"warning: {warning}")
    if problems:
        raise ConfigError(
            f"the store {root.url} was precomputed for other teachers or routing than this config:\n  "
            + "\n  ".join(problems)
            + "\nrun `mopd precompute` with this config (into a new store.path), or train with the config "
            "that built the store"
        )
    if data:
        log(
            f"warning: the store {root.url} was built with other data settings than this config ("
            + "; ".join(data)
            + "); the store, not the config, is what trains"
        )
