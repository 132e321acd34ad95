"""Temporaries that stopped jobs left in a store: removed by the next job on their host, listed by verify.

A task folder, part record or manifest is written under `<name>.tmp-<pid>@<host>-<uuid>` and renamed or
linked onto its name; a job killed in between leaves the temporary behind. It is never part of the store
(readers and `verify-manifest` skip it), only disk space. Each job that opens the store removes those
whose owner was a process of its own host that no longer runs; `verify-manifest` lists every one left
(another host's, an earlier mopd's) with the command that removes it.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterable
from pathlib import Path

from mopd.base.fsio import is_temporary, owner_stopped, temporary_owner
from mopd.store.manifest import PARTS_DIR


def temporaries(root: Path, task_paths: Iterable[str]) -> list[Path]:
    """Every temporary beside the store's records and task folders."""
    folders = {root, root / PARTS_DIR, *((root / path).parent for path in task_paths)}
    found = []
    for folder in sorted(folders):
        try:
            with os.scandir(folder) as entries:
                found += [Path(e.path) for e in entries if is_temporary(e.name) and not e.is_symlink()]
        except FileNotFoundError:
            continue
    return sorted(found)


def remove_stopped(root: Path, task_paths: Iterable[str]) -> list[Path]:
    """Removes the temporaries whose owner was a process of this host that no longer runs."""
    removed = []
    for path in temporaries(root, task_paths):
        if owner_stopped(path.name):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def describe(root: Path, path: Path) -> str:
    """One line: the temporary, who left it, and the command that removes it."""
    owner = temporary_owner(path.name)
    who = f"process {owner[0]} on {owner[1] or 'an unnamed host'}" if owner else "a job of an earlier mopd"
    return (
        f"{path.relative_to(root)}: a temporary left by a job that stopped ({who}), not part of the store; "
        f"once no job writes this store, remove it with `rm -rf {shlex.quote(str(path))}`"
    )
