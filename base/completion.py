"""Completion markers: a folder counts as finished only once its marker, written last, lists every file
in it with its size and sha256 (training checkpoints use it; DESIGN §7).

The marker makes a damaged folder nameable: `check_complete` reports each file that is missing, of
another size or another content, and each file the marker does not list.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mopd.base.errors import CheckpointError
from mopd.base.fsio import is_temporary, sha256_file, write_replace
from mopd.base.jsonio import read_json

COMPLETE = "COMPLETE"
_THREADS = min(8, os.cpu_count() or 1)


def _listing(folder: Path) -> list[str]:
    files = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not is_temporary(d))
        for name in sorted(names):
            rel = (Path(parent) / name).relative_to(folder).as_posix()
            if rel != COMPLETE and not is_temporary(name):
                files.append(rel)
    return files


def _digests(folder: Path, files: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        return list(pool.map(lambda rel: sha256_file(folder / rel), files))


def write_complete(folder: Path, info: dict[str, Any]) -> None:
    """Writes the marker of a fully written folder: `info` plus every file's size and sha256."""
    files = _listing(folder)
    listed = {
        rel: [(folder / rel).stat().st_size, digest]
        for rel, digest in zip(files, _digests(folder, files), strict=True)
    }
    write_replace(folder / COMPLETE, json.dumps({**info, "files": listed}, indent=1, sort_keys=True).encode())


def read_complete(folder: Path) -> dict[str, Any]:
    """The marker of a complete folder.

    Raises:
        CheckpointError: no marker, an unreadable one, or one without a file list (an earlier mopd's).
    """
    path = folder / COMPLETE
    try:
        marker = read_json(path, what="completion marker", error=CheckpointError)
    except FileNotFoundError as err:
        raise CheckpointError(f"{folder} is not complete (no {COMPLETE} marker)") from err
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
        for v in files.values()
    ):
        raise CheckpointError(
            f"{path} lists no files with sizes and hashes (an earlier mopd's, or damaged); it cannot "
            "be checked: start a new run from it with `train.init_from`"
        )
    return marker


def check_complete(folder: Path, *, full: bool = True) -> list[str]:
    """Every way the folder differs from its marker, one line each (empty: complete and unchanged).

    Raises:
        CheckpointError: the marker is missing or unreadable.
    """
    files: dict[str, list] = read_complete(folder)["files"]
    problems, present = [], []
    for rel, (size, _digest) in sorted(files.items()):
        path = folder / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{folder / COMPLETE}: lists a path outside the folder: {rel}")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, the marker records {size} (truncated?)")
        else:
            present.append(rel)
    if full:
        for rel, digest in zip(present, _digests(folder, present), strict=True):
            if digest != files[rel][1]:
                problems.append(f"{folder / rel}: content changed (sha256 differs from the marker)")
    problems += [f"{folder / rel}: not listed in the marker" for rel in _listing(folder) if rel not in files]
    return problems
