"""`verify-manifest`: every way store, config and training checkpoint disagree, one line each.

Never writes: it works on a read-only store. Quick mode checks that every recorded file exists with its
recorded size and that arrays have their recorded shapes; `full=True` also re-hashes every byte.
"""

from __future__ import annotations

import os
from pathlib import Path

from mopd.store.arrays import open_array
from mopd.store.config import MopdConfig
from mopd.store.errors import ConfigError, MopdError
from mopd.store.fingerprint import checkpoint_fingerprint
from mopd.store.fsio import is_temporary, safe_join, sha256_file
from mopd.store.manifest import PARTS_DIR, ArtifactRecord, Manifest, artifact_hash, load_part
from mopd.store.reader import read_manifest
from mopd.store.teachers import (
    TeacherIdentity,
    assign_teacher_indices,
    diff_teacher_lists,
    read_teacher_list,
)


def _check_artifact(root: Path, artifact: ArtifactRecord, *, full: bool) -> list[str]:
    try:
        folder = safe_join(root, artifact.path)
    except MopdError as err:
        return [str(err)]
    if not folder.exists():
        return [f"{artifact.path}: missing ({artifact.kind} of task {artifact.task_id} was deleted)"]
    part_path = root / PARTS_DIR / f"{artifact.task_id}.json"
    if not part_path.exists():
        return [f"{part_path.relative_to(root)}: part record of task {artifact.task_id} is missing"]
    if sha256_file(part_path) != artifact.part_sha256:
        return [f"{part_path.relative_to(root)}: part record changed since the manifest was written"]
    part = load_part(part_path)
    if artifact_hash(part.files) != artifact.hash:
        return [f"{part_path.relative_to(root)}: file list does not match the manifest's hash"]
    problems = []
    for rel, (size, digest) in part.files.items():
        try:
            path = safe_join(folder, rel)
        except MopdError as err:
            problems.append(f"{part_path.relative_to(root)}: {err}")
            continue
        if not path.is_file():
            problems.append(f"{artifact.path}/{rel}: missing")
        elif path.stat().st_size != size:
            problems.append(
                f"{artifact.path}/{rel}: {path.stat().st_size} bytes, recorded {size} (truncated?)"
            )
        elif full and sha256_file(path) != digest:
            problems.append(f"{artifact.path}/{rel}: content changed (sha256 differs from the record)")
    for folder_name, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not is_temporary(d)]
        for name in files:
            rel = (Path(folder_name) / name).relative_to(folder).as_posix()
            if rel not in part.files and not is_temporary(name):
                problems.append(f"{artifact.path}/{rel}: unexpected file, not in the part record")
    return problems


def _check_shapes(root: Path, manifest: Manifest) -> list[str]:
    problems = []
    rows = manifest.rows
    expected: dict[str, tuple[int, ...]] = {
        "offsets": (manifest.dataset.num_rows + 1,),
        "teacher_index": (manifest.dataset.num_rows,),
        "input_ids": (manifest.dataset.num_tokens,),
        "loss_mask": (manifest.dataset.num_tokens,),
    }
    hidden = {t.index: t.hidden_size for t in manifest.teachers}
    vocab = {t.index: t.vocab_size for t in manifest.teachers}
    checks: list[tuple[str, str, tuple[int, ...]]] = [
        (rows.path, name, shape) for name, shape in expected.items()
    ]
    checks += [(a.path, "", (vocab[a.teacher or 0], hidden[a.teacher or 0])) for a in manifest.lm_heads]
    for shard in manifest.shards:
        checks += [
            (shard.path, "hidden", (shard.tokens, hidden[shard.teacher or 0])),
            (shard.path, "offsets", (shard.rows + 1,)),
            (shard.path, "row_ids", (shard.rows,)),
        ]
    for folder, name, shape in checks:
        path = root / folder / name if name else root / folder
        where = f"{folder}/{name}" if name else folder
        if not (path / "zarr.json").exists():
            continue  # reported as a missing file or folder already
        try:
            found = open_array(path).shape
        except Exception as err:
            problems.append(f"{where}: unreadable array metadata ({err})")
            continue
        if tuple(found) != shape:
            problems.append(f"{where}: shape {tuple(found)}, recorded {shape}")
    return problems


def store_teachers(manifest: Manifest) -> list[TeacherIdentity]:
    return [TeacherIdentity(t.index, t.checkpoint, t.fingerprint) for t in manifest.teachers]


def config_teachers(config: MopdConfig) -> tuple[list[TeacherIdentity], list[str]]:
    """The config's teacher list, fingerprinted where the checkpoint is reachable; plus warnings."""
    teachers, warnings = [], []
    for slot in assign_teacher_indices(config.teachers):
        fingerprint = None
        if Path(slot.checkpoint).is_dir():
            try:
                fingerprint = checkpoint_fingerprint(slot.checkpoint)
            except ConfigError as err:
                warnings.append(f"cannot fingerprint teacher {slot.index}: {err}")
        else:
            warnings.append(
                f"teacher {slot.index} checkpoint {slot.checkpoint} is not reachable here; "
                "compared by path only"
            )
        teachers.append(TeacherIdentity(slot.index, slot.checkpoint, fingerprint))
    return teachers, warnings


def verify_store(
    root: str | Path,
    *,
    config: MopdConfig | None = None,
    checkpoint: str | Path | None = None,
    full: bool = False,
) -> tuple[list[str], list[str]]:
    """Checks a store, and optionally a config and a training checkpoint against it.

    Returns:
        (problems, warnings): each one line; the store is sound and agrees when `problems` is empty.
    """
    root = Path(root)
    try:
        manifest = read_manifest(root)
    except MopdError as err:
        return [str(err)], []
    problems: list[str] = []
    warnings: list[str] = []
    for artifact in manifest.artifacts():
        problems += _check_artifact(root, artifact, full=full)
    problems += _check_shapes(root, manifest)
    expected = store_teachers(manifest)
    if config is not None:
        found, config_warnings = config_teachers(config)
        warnings += config_warnings
        problems += diff_teacher_lists(expected, found, expected_name="store", found_name="config")
    if checkpoint is not None:
        try:
            recorded = read_teacher_list(Path(checkpoint))
        except MopdError as err:
            problems.append(str(err))
        else:
            problems += diff_teacher_lists(expected, recorded, expected_name="store", found_name="checkpoint")
    return problems, warnings
