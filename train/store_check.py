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
from mopd.store.format.manifest import Manifest
from mopd.store.format.provenance import recorded_source, same_source
from mopd.store.locations.location import Location
from mopd.store.verify import check_config, check_routing
from mopd.train.backends.groups import RankGroup


def store_differences(config: MopdConfig, manifest: Manifest) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the config's teachers, aliases and routing against the store's, one line
    each; the teachers' checkpoints are fingerprinted where they are reachable."""
    problems, warnings = check_config(manifest, config.teachers)
    problems += check_routing(manifest, config.routing.model_dump(mode="json"), config.teachers)
    return problems, warnings


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
