"""`verify-manifest`: every way store and config disagree, one line each (and a training checkpoint:
`mopd.train.checkpoint.verify`).

Never writes: it works on a read-only store. Quick mode checks that every recorded file exists with its
recorded size, that arrays have the shapes and dtypes `layout.py` declares and that each
array's shard index and every chunk's checksum are the ones its part record lists — a file copied in from
another store is found whatever its size, without decoding a chunk; `full=True` also re-hashes every
byte (on parallel threads).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mopd.base.errors import ConfigError, MopdError
from mopd.base.fsio import LINK_REFUSED, safe_relative
from mopd.store.arrays.binding import Recorded
from mopd.store.arrays.read import array_header, check_recorded_chunks
from mopd.store.arrays.write import storage_dtype
from mopd.store.format.fingerprint import checkpoint_fingerprint
from mopd.store.format.layout import artifact_arrays
from mopd.store.format.loading import part_key, read_manifest, read_record
from mopd.store.format.manifest import (
    ArtifactRecord,
    Manifest,
    PartRecord,
    TeacherEntry,
    artifact_hash,
    parse_part,
)
from mopd.store.format.teachers import TeacherSlot, assign_teacher_indices, normalise_checkpoint
from mopd.store.locations.location import Location, open_location
from mopd.store.temporaries import describe as describe_temporary
from mopd.store.temporaries import temporaries

_Checked = tuple[list[str], list[tuple[str, str, str]], PartRecord | None]


def _check_artifact(location: Location, manifest: Manifest, artifact: ArtifactRecord) -> _Checked:
    """Problems of one task folder, (file, recorded sha256, where) for a full check to hash, and its part
    record (None where it is missing or not the one the manifest lists)."""
    try:
        folder = safe_relative(artifact.path)
    except MopdError as err:
        return [str(err)], [], None
    if not location.is_folder(folder):
        deleted = f"{artifact.path}: missing ({artifact.kind} of task {artifact.task_id} was deleted)"
        return [deleted], [], None
    where = part_key(artifact.task_id)
    part_path = location.describe(where)
    try:
        data = read_record(location, where, "part record")
    except FileNotFoundError:
        return [f"{where}: part record of task {artifact.task_id} is missing"], [], None
    except MopdError as err:
        return [str(err)], [], None
    if hashlib.sha256(data).hexdigest() != artifact.part_sha256:
        return [f"{where}: part record changed since the manifest was written"], [], None
    try:
        part = parse_part(data, part_path)
    except MopdError as err:
        return [str(err)], [], None
    if artifact_hash(part.files) != artifact.hash:
        return [f"{where}: file list does not match the manifest's hash"], [], None
    found, links = location.listing(folder)
    problems = [f"{artifact.path}/{rel}: {LINK_REFUSED}" for rel in links]
    to_hash = []
    for rel, (size, digest) in part.files.items():
        if not _plain_relative(rel):
            problems.append(f"{where}: path {rel!r} must be relative and stay inside the store")
        elif any(rel == link or rel.startswith(f"{link}/") for link in links):
            continue  # reported as a link
        elif rel not in found:
            problems.append(f"{artifact.path}/{rel}: missing")
        elif found[rel] != size:
            problems.append(
                f"{artifact.path}/{rel}: {found[rel]} bytes, recorded {size} (truncated, or another file)"
            )
        else:
            to_hash.append((f"{folder}/{rel}", digest, f"{artifact.path}/{rel}"))
    problems += [
        f"{artifact.path}/{rel}: unexpected file, not in the part record"
        for rel in sorted(found.keys() - part.files.keys())
    ]
    return problems, to_hash, part


def _plain_relative(rel: str) -> bool:
    parts = rel.split("/")
    return not rel.startswith("/") and all(part not in ("", ".", "..") for part in parts)


# Threads hashing files for `--full`: more than the cores, so that reads overlap (the disk, or a
# networked filesystem, serves several at once) while sha256 keeps every core busy.
HASH_THREADS = 8

# From this many task folders on, their checks are split over processes (the work is Python and
# system calls: a store of 10k shards takes ~3.5 s on one core of the development machine).
PARALLEL_FOLDERS = 2000

# Task folders per block of the metadata pass: each block's files start hashing as soon as it is done.
FOLDERS_PER_BLOCK = 64


def _check_store(root: Location, manifest: Manifest, *, full: bool, threads: int) -> list[str]:
    """Every task folder against its records; with `full`, every recorded file against its sha256.

    The hashing overlaps the folder checks: each block's files are queued to `threads` threads (sha256
    releases the GIL) as soon as the block is checked, so that `--full` costs about one read of the
    store, not a metadata pass and then a read.
    """
    problems: list[str] = []
    hashed: list[tuple[Future[str], str, str]] = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found, files in _folder_checks(root, manifest):
            problems += found
            if full:
                hashed += [(pool.submit(root.sha256, key), digest, where) for key, digest, where in files]
        problems += [
            f"{where}: content changed (sha256 differs from the record)"
            for digest, recorded, where in hashed
            if digest.result() != recorded
        ]
    return problems


def _folder_checks(
    root: Location,
    manifest: Manifest,
    *,
    parallel_from: int = PARALLEL_FOLDERS,
    per_block: int = FOLDERS_PER_BLOCK,
) -> Iterator[tuple[list[str], list[tuple[str, str, str]]]]:
    """Blocks of task folders checked against their records and their arrays' headers against the
    layout, in manifest order: each block's problems and the files a full check hashes."""
    artifacts = list(manifest.artifacts())
    spans = [(i, min(i + per_block, len(artifacts))) for i in range(0, len(artifacts), per_block)]
    if len(artifacts) < parallel_from or len(spans) <= 1:
        yield from (_check_block(root, manifest, artifacts[start:stop]) for start, stop in spans)
        return
    # fork: the children need nothing but the store and its manifest, inherited as they are, and start
    # in milliseconds. A caller with threads running (a lock one of them holds would stay held in the
    # child) gets forkserver's clean children instead, each sent the manifest once. Blocks then name
    # their folders by position: a 10k-shard manifest is megabytes, not to be sent per block.
    context = multiprocessing.get_context("fork" if threading.active_count() == 1 else "forkserver")
    with ProcessPoolExecutor(
        max_workers=4, mp_context=context, initializer=_hold, initargs=(root, manifest)
    ) as pool:
        yield from pool.map(_check_span, spans)


# A folder-check worker's store and manifest (`_hold`), and the manifest's task folders.
_HELD: tuple[Location, Manifest, list[ArtifactRecord]] | None = None


def _hold(root: Location, manifest: Manifest) -> None:
    global _HELD
    _HELD = (root, manifest, list(manifest.artifacts()))


def _check_span(span: tuple[int, int]) -> tuple[list[str], list[tuple[str, str, str]]]:
    assert _HELD is not None, "a folder-check worker starts with _hold"
    root, manifest, artifacts = _HELD
    return _check_block(root, manifest, artifacts[span[0] : span[1]])


def _check_block(
    root: Location, manifest: Manifest, artifacts: list[ArtifactRecord]
) -> tuple[list[str], list[tuple[str, str, str]]]:
    problems: list[str] = []
    to_hash: list[tuple[str, str, str]] = []
    for artifact in artifacts:
        found, files, part = _check_artifact(root, manifest, artifact)
        found += _check_arrays(root, manifest, artifact, part if not found else None)
        problems += found
        to_hash += files
    return problems, to_hash


def _check_arrays(
    root: Location, manifest: Manifest, artifact: ArtifactRecord, part: PartRecord | None
) -> list[str]:
    """Each array of a task folder has the shape and dtype `layout.py` declares; given its part record
    its zarr.json, shard index and chunk checksums are the recorded ones, read without
    decoding a chunk."""
    problems = []
    for array in artifact_arrays(artifact, manifest):
        where = f"{artifact.path}/{array.name}".rstrip("/")
        try:
            shape, dtype, header = array_header(root, where, where)
        except FileNotFoundError:
            continue  # reported as a missing file or folder already
        except MopdError as err:
            problems.append(f"{where}: unreadable array metadata ({err})")
            continue
        if shape != array.shape:
            problems.append(f"{where}: shape {shape}, recorded {array.shape}")
        elif array.dtype != "string" and dtype != storage_dtype(array.dtype).name:
            problems.append(f"{where}: dtype {dtype}, the layout says {array.dtype}")
        elif part is not None and array.dtype != "string":  # a string column: zarr-python's own layout
            try:
                recorded = Recorded.of(part.files, array.name)
                check_recorded_chunks(root, where, where, recorded, header)
            except MopdError as err:
                problems.append(str(err))
    return problems


def _config_fingerprints(teachers: Mapping[str, str]) -> tuple[dict[str, str | None], list[str]]:
    """The fingerprint of each configured checkpoint that is reachable here (None elsewhere), as the
    store records them; plus warnings."""
    found: dict[str, str | None] = {}
    warnings = []
    for slot in assign_teacher_indices(teachers):
        found[slot.checkpoint] = None
        if not Path(slot.checkpoint).is_dir():
            warnings.append(f"checkpoint {slot.checkpoint} is not reachable here; compared by path only")
            continue
        try:
            found[slot.checkpoint] = checkpoint_fingerprint(slot.checkpoint)
        except ConfigError as err:
            warnings.append(f"cannot fingerprint {slot.checkpoint}: {err}")
    return found, warnings


def missing_teachers(manifest: Manifest, teachers: Mapping[str, str]) -> list[str]:
    """A line for each configured teacher checkpoint (alias → checkpoint) that is not there and is not
    one the store records (which may be absent where training runs): a wrong path, not a different
    teacher; the line names the checkpoint the store has under that alias."""
    recorded = {t.checkpoint for t in manifest.teachers}
    problems = []
    for alias, checkpoint in teachers.items():
        path = normalise_checkpoint(checkpoint)
        if path in recorded or Path(path).is_dir():
            continue
        stored = next((t for t in manifest.teachers if alias in t.aliases), None)
        instead = f" (the store's teacher {stored.index} is {stored.checkpoint})" if stored else ""
        problems.append(f"teachers.{alias}: checkpoint {path} does not exist{instead}; correct the path")
    return problems


def check_teachers(
    manifest: Manifest, teachers: Mapping[str, str], routing: Mapping[str, Any] | None
) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a config's teachers (alias → checkpoint) and routing against the store's:
    a checkpoint that is not there is named alone, since the numbering of the rest follows from its
    wrong path; else `check_config`, then `check_routing` (skipped where `routing` is None)."""
    missing = missing_teachers(manifest, teachers)
    if missing:
        return missing, []
    problems, warnings = check_config(manifest, teachers)
    return problems + (check_routing(manifest, routing, teachers) if routing is not None else []), warnings


def check_config(manifest: Manifest, teachers: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The config's teachers (alias → checkpoint) are the store's: the same bytes at the same index, and
    every alias both name points at the same teacher (renaming aliases is fine; swapping two is not).

    Returns:
        (problems, warnings).
    """
    fingerprints, warnings = _config_fingerprints(teachers)
    slots = assign_teacher_indices(teachers)
    stored = {t.index: t for t in manifest.teachers}

    def same(teacher: TeacherEntry, slot: TeacherSlot) -> bool:
        found = fingerprints[slot.checkpoint]
        return found == teacher.fingerprint if found is not None else slot.checkpoint == teacher.checkpoint

    match = {slot.index: next((t.index for t in manifest.teachers if same(t, slot)), None) for slot in slots}
    matched = set(match.values())
    problems = []
    for slot in slots:
        teacher = stored.get(slot.index)
        if match[slot.index] is None and teacher is not None and teacher.index not in matched:
            problems.append(
                f"teacher {slot.index} ({', '.join(sorted(set(teacher.aliases) | set(slot.aliases)))}): the "
                f"store's is {teacher.checkpoint} with fingerprint {teacher.fingerprint}; the config's is "
                f"{slot.checkpoint} with fingerprint {fingerprints[slot.checkpoint] or 'unknown'}: a "
                "different teacher"
            )
            matched.add(teacher.index)
        elif match[slot.index] is None:
            problems.append(
                f"teacher {slot.index} ({slot.checkpoint}; aliases {', '.join(slot.aliases)}) is added in "
                "the config; the store does not have it"
            )
        elif match[slot.index] != slot.index:
            problems.append(
                f"teacher {slot.checkpoint} is renumbered: index {match[slot.index]} in the store, "
                f"{slot.index} in the config"
            )
    for teacher in manifest.teachers:
        if teacher.index not in matched:
            problems.append(
                f"teacher {teacher.index} ({teacher.checkpoint}; aliases {', '.join(teacher.aliases)}) is in "
                "the store but dropped from the config"
            )
    return problems + _moved_aliases(manifest, slots, match), warnings


def _moved_aliases(manifest: Manifest, slots: list[TeacherSlot], match: dict[int, int | None]) -> list[str]:
    """An alias that names one teacher in the store and another in the config (`match`: each config
    teacher's index in the store)."""
    problems = []
    for slot in slots:
        for alias in slot.aliases:
            teacher = next((t for t in manifest.teachers if alias in t.aliases), None)
            if teacher is not None and match[slot.index] not in (None, teacher.index):
                problems.append(
                    f"alias {alias} names teacher {teacher.index} ({teacher.checkpoint}) in the store, but "
                    f"{slot.checkpoint} (the store's teacher {match[slot.index]}) in the config"
                )
    return problems


def check_routing(manifest: Manifest, routing: Mapping[str, Any], teachers: Mapping[str, str]) -> list[str]:
    """The config's routing (its `routing` section as a mapping, over its `teachers`) sends every agent
    to the teacher the store's rows were routed to; renaming an alias on both sides changes nothing.
    A store that recorded no routing (a synthetic one) is not compared.

    Returns:
        One line per difference, naming the config key and both values.
    """
    stored = manifest.config.routing
    if stored is None:
        return []
    sides = (
        ({alias: t.index for t in manifest.teachers for alias in t.aliases}, stored),
        ({alias: s.index for s in assign_teacher_indices(teachers) for alias in s.aliases}, routing),
    )

    def resolve(side: int, aliases: str | list[str] | None) -> tuple[list[int | None] | None, str]:
        """(teacher indices, how to show them) of an alias or a list of them on one side: the store (0)
        or the config (1)."""
        if aliases is None:
            return None, "none"
        if isinstance(aliases, str):
            index = sides[side][0].get(aliases)
            return [index], f"teacher {index} (alias {aliases!r})"
        found = {a: sides[side][0].get(a) for a in aliases}
        indices = sorted(set(found.values()), key=lambda i: -1 if i is None else i)
        shown = ", ".join(f"{a!r}" for a in found)
        return indices, f"teachers {', '.join(str(i) for i in indices)} (aliases {shown})"

    def routed(side: int) -> dict[str, str]:
        index, section = sides[side]
        return dict(section.get("teacher_by_agent") or {alias: alias for alias in index})

    problems = []
    for field in ("field", "teachers_field"):
        if stored.get(field) != routing.get(field):
            problems.append(
                f"routing.{field}: {stored.get(field)!r} in the store, {routing.get(field)!r} in the config"
            )
    old_agents, new_agents = routed(0), routed(1)
    pairs = [
        (f"teacher_by_agent.{agent}", old_agents.get(agent), new_agents.get(agent))
        for agent in sorted(set(old_agents) | set(new_agents))
    ]
    pairs.append(("default_teacher", stored.get("default_teacher"), routing.get("default_teacher")))
    for key, old_alias, new_alias in pairs:
        (old, old_text), (new, new_text) = resolve(0, old_alias), resolve(1, new_alias)
        if old != new:
            problems.append(f"routing.{key}: {old_text} in the store, {new_text} in the config")
    return problems


def verify_store(
    root: str | Path | Location,
    *,
    options: Mapping[str, str] | None = None,
    teachers: Mapping[str, str] | None = None,
    routing: Mapping[str, Any] | None = None,
    encoding: str | None = None,
    full: bool = False,
    threads: int | None = None,
) -> tuple[list[str], list[str]]:
    """Checks a store (a folder or an object-storage URL, `options` its client's settings), and optionally
    a config's teachers (alias → checkpoint), routing (its `routing` section as a mapping) and
    `store.encoding` against it (a training checkpoint: `mopd.train.checkpoint.verify`).

    Returns:
        (problems, warnings): each one line; the store is sound and agrees when `problems` is empty.
    """
    try:
        root = open_location(root, options)
        manifest = read_manifest(root)
    except MopdError as err:
        return [str(err)], []
    problems: list[str] = []
    warnings: list[str] = []
    problems += _check_store(root, manifest, full=full, threads=threads or HASH_THREADS)
    left = temporaries(root, (artifact.path for artifact in manifest.artifacts()))
    warnings += [describe_temporary(root, key) for key in left]
    if teachers is not None:
        found, config_warnings = check_teachers(manifest, teachers, routing)
        problems += found
        warnings += config_warnings
    if encoding is not None and encoding != manifest.storage.encoding:
        problems.append(
            f"store.encoding: {manifest.storage.encoding!r} in the store, {encoding!r} in the config (a "
            "precompute with this config would refuse the store; training reads it as it is stored)"
        )
    return problems, warnings
