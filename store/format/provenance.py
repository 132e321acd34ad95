"""Where a store's rows came from: the ingest records precompute keeps inside the store.

The first precompute job of a store tokenises and routes the dataset once and keeps the result, with a
record of its inputs, under `STORE/ingest/<key>/`; every later job reads it. The record lists each data
file with its size and sha256, so a later reader can tell whether the data a config names is still the
data the store was built from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd.base.errors import ManifestError
from mopd.base.fsio import files_digest
from mopd.base.jsonio import MAX_RECORD_BYTES, parse_json
from mopd.store.locations.location import Location

INGEST_DIR = "ingest"
INGEST_RECORD = "ingest.json"


def recorded_source(store: Location, fingerprint: str) -> list[tuple[str, int, str]] | None:
    """The data files (relative path, size, sha256) whose tokenised rows have `fingerprint` (the
    manifest's dataset fingerprint), as the store's ingest record lists them; None where the store holds
    no such record (it was removed, or the store was built by hand)."""
    for name in store.names(INGEST_DIR):
        key = f"{INGEST_DIR}/{name}/{INGEST_RECORD}"
        try:
            data = store.read_record(key, "ingest record", limit=MAX_RECORD_BYTES)
            meta: Any = parse_json(data, what=store.describe(key), error=ManifestError)
            if meta["rows"]["fingerprint"] == fingerprint:
                return [(str(name), int(size), str(sha)) for name, size, sha in meta["inputs"]["source"]]
        except (OSError, ManifestError, KeyError, TypeError, ValueError):
            continue  # a damaged or foreign record proves nothing either way
    return None


def same_source(path: Path, recorded: list[tuple[str, int, str]]) -> bool:
    """`path` (a data file or folder) holds exactly the recorded files, by size then sha256."""
    if not path.exists():
        return False
    if path.is_file():
        sizes = [(path.name, path.stat().st_size)]
    else:
        sizes = [
            (p.relative_to(path).as_posix(), p.stat().st_size) for p in sorted(path.rglob("*")) if p.is_file()
        ]
    if sizes != [(name, size) for name, size, _ in recorded]:
        return False  # no file is hashed when the sizes already differ
    return [tuple(d) for d in files_digest(path)] == [tuple(r) for r in recorded]
