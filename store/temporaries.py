"""Temporaries that stopped jobs left in a store: removed by the next job on their host, listed by verify.

A task folder, part record or manifest is written under `<name>.tmp-<pid>@<host>-<uuid>` and renamed or
linked onto its name; a job killed in between leaves the temporary behind. It is never part of the store
(readers and `verify-manifest` skip it), only disk space. Each job that opens the store removes those
whose owner was a process of its own host that no longer runs; `verify-manifest` lists every one left
(another host's, an earlier mopd's) with the command that removes it.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Iterable

from mopd.base.fsio import owner_stopped, temporary_owner
from mopd.store.format.manifest import PARTS_DIR
from mopd.store.locations.location import Location


def temporaries(location: Location, task_paths: Iterable[str]) -> list[str]:
    """Every temporary beside the store's records and task folders (keys)."""
    return location.temporaries({"", PARTS_DIR, *(posixpath.dirname(path) for path in task_paths)})


def remove_stopped(location: Location, task_paths: Iterable[str]) -> list[str]:
    """Removes the temporaries whose owner was a process of this host that no longer runs."""
    removed = []
    for key in temporaries(location, task_paths):
        if owner_stopped(posixpath.basename(key)):
            location.remove(key)
            removed.append(key)
    return removed


def describe(location: Location, key: str) -> str:
    """One line: the temporary, who left it, and the command that removes it."""
    owner = temporary_owner(posixpath.basename(key))
    who = f"process {owner[0]} on {owner[1] or 'an unnamed host'}" if owner else "a job of an earlier mopd"
    return (
        f"{key}: a temporary left by a job that stopped ({who}), not part of the store; once no job "
        f"writes this store, remove it with `rm -rf {shlex.quote(location.describe(key))}`"
    )
