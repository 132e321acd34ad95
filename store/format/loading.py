"""Reading a store's records from where it lives (a folder or a bucket): the manifest, the plan, part
records and calibration records, each refused in one line when missing, oversized, linked or invalid
(`manifest.py` holds the records and their parsers)."""

from __future__ import annotations

from pathlib import Path

from mopd.base.errors import ManifestError, MopdError, StoreIncompleteError
from mopd.base.jsonio import MAX_RECORD_BYTES
from mopd.store.arrays.binding import Recorded
from mopd.store.format.manifest import (
    CALIBRATION_FILE,
    MANIFEST_FILE,
    PARTS_DIR,
    PLAN_FILE,
    EncodingInfo,
    Manifest,
    PartRecord,
    Plan,
    parse_calibration,
    parse_manifest,
    parse_part,
    parse_plan,
)
from mopd.store.locations.location import Location, open_location


def read_calibration(location: Location, folder: str, part: PartRecord) -> EncodingInfo:
    """An encoding task's calibration record, proved to be the one its part record lists.

    Raises:
        StoreIntegrityError: it is not.
    """
    key = f"{folder}/{CALIBRATION_FILE}"
    data = read_record(location, key, "calibration record")
    Recorded(part.files).check(CALIBRATION_FILE, data, location.describe(key))
    return parse_calibration(data, location.describe(key))


def read_record(location: Location, key: str, what: str) -> bytes:
    """A record's bytes, refusing a missing, oversized or linked file with a `ManifestError` naming it
    (a part record's folder too: records are the store's own files, never links to others).

    Raises:
        FileNotFoundError: there is no such record.
    """
    return location.read_record(key, what, limit=MAX_RECORD_BYTES)


def part_key(task_id: str) -> str:
    """The key of a task's part record."""
    return f"{PARTS_DIR}/{task_id}.json"


def load_manifest(store: Location | str | Path) -> Manifest:
    """Reads and validates the store's `manifest.json`.

    Raises:
        FileNotFoundError: there is no manifest (the store is not finalized).
        ManifestError: see `parse_manifest`.
    """
    location = open_location(store)
    return parse_manifest(read_record(location, MANIFEST_FILE, "manifest"), location.describe(MANIFEST_FILE))


def load_plan(store: Location | str | Path) -> Plan:
    location = open_location(store)
    return parse_plan(read_record(location, PLAN_FILE, "plan"), location.describe(PLAN_FILE))


def load_part(store: Location | str | Path, task_id: str) -> PartRecord:
    location = open_location(store)
    key = part_key(task_id)
    data = read_record(location, key, "part record")
    return parse_part(data, location.describe(key))


def task_progress(location: Location) -> tuple[int, int]:
    """(done, total) tasks of an unfinalized store, from its plan and part records."""
    plan = load_plan(location)
    done = {name.removesuffix(".json") for name in location.names(PARTS_DIR)}
    return sum(task.task_id in done for task in plan.tasks), len(plan.tasks)


def _holds_store(location: Location, name: str) -> bool:
    """Whether the folder `name` of `location` is a store (a manifest or a plan in it)."""
    try:
        return location.is_folder(name) and any(
            location.exists(f"{name}/{record}") for record in (MANIFEST_FILE, PLAN_FILE)
        )
    except MopdError:  # a file, a symbolic link: not a store
        return False


def read_manifest(store: Location | str | Path) -> Manifest:
    """The store's manifest; a missing one is reported with how many tasks are done.

    Raises:
        StoreIncompleteError: no manifest yet (message says done/total tasks and what to run).
        ManifestError: not a store, or an unsupported format.
    """
    location = open_location(store)
    try:
        return load_manifest(location)
    except FileNotFoundError:
        pass
    if not location.is_folder(""):
        raise ManifestError(f"store {location.url} does not exist")
    if not location.exists(PLAN_FILE):
        below = [name for name in sorted(location.names(""))[:1000] if _holds_store(location, name)]
        hint = (
            f"; the store one folder down is {location.url.rstrip('/')}/{below[0]}" if len(below) == 1 else ""
        )
        hint = f"; stores one folder down: {', '.join(below)}" if len(below) > 1 else hint
        raise ManifestError(
            f"{location.url} is not a mopd store: it has no {MANIFEST_FILE} and no {PLAN_FILE}{hint}"
        )
    done, total = task_progress(location)
    raise StoreIncompleteError(
        f"{location.url} has no {MANIFEST_FILE}: {done} of {total} tasks are done; run `mopd precompute` "
        "again with the same config to finish it (finished tasks are skipped)"
    )
