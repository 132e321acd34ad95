"""Finalize: prove exact row coverage, build the deterministic manifest, publish it no-clobber."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mopd.base.errors import StoreIntegrityError
from mopd.base.fsio import safe_relative
from mopd.store.arrays.binding import Recorded
from mopd.store.arrays.read import ArrayReader
from mopd.store.format.layout import ROW_IDS, TEACHER_INDEX, TEACHER_SET, scored_by
from mopd.store.format.loading import load_manifest
from mopd.store.format.manifest import (
    CROSS_TOKENIZER,
    FORMAT,
    FORMAT_VERSION,
    INT8_ROTATED,
    MANIFEST_FILE,
    TEACHER_SETS,
    ArtifactRecord,
    EncodingArtifact,
    EncodingTask,
    HeadArtifact,
    HeadTask,
    Manifest,
    PartRecord,
    Plan,
    ProjectionArtifact,
    ProjectionTask,
    RowsArtifact,
    RowsTask,
    ShardArtifact,
    ShardTask,
    TaskSpec,
    TeacherEntry,
    canonical_json,
)
from mopd.store.locations.location import Location


def _read_all(root: Location, folder: str, name: str, part: PartRecord, plan: Plan) -> np.ndarray:
    recorded = Recorded.of(part.files, name)
    key = safe_relative(f"{folder}/{name}")
    return ArrayReader(root, key, label=key, recorded=recorded).read()


def check_coverage(root: Location, plan: Plan, parts: Mapping[str, PartRecord]) -> None:
    """Every row of teacher i is in exactly one of teacher i's shards, within its task's row range.

    Raises:
        StoreIntegrityError: naming the teacher and the first rows missing or stored twice.
    """
    rows_task = next(t for t in plan.tasks if isinstance(t, RowsTask))
    part = parts[rows_task.task_id]
    teacher_index = _read_all(root, rows_task.path, TEACHER_INDEX, part, plan)
    sets = _read_all(root, rows_task.path, TEACHER_SET, part, plan) if plan.dataset.teacher_sets else None
    if teacher_index.shape[0] != plan.dataset.num_rows:
        raise StoreIntegrityError(
            f"rows hold {teacher_index.shape[0]} rows, the plan has {plan.dataset.num_rows}"
        )
    for teacher in plan.teachers:
        expected = np.flatnonzero(scored_by(teacher_index, sets, teacher.index))
        stored = []
        for task in plan.tasks:
            if not isinstance(task, ShardTask) or task.teacher != teacher.index:
                continue
            row_ids = _read_all(root, task.path, ROW_IDS, parts[task.task_id], plan)
            outside = row_ids[(row_ids < task.row_start) | (row_ids >= task.row_stop)]
            if outside.size:
                raise StoreIntegrityError(
                    f"task {task.task_id} stores rows {outside[:5].tolist()} "
                    f"outside its range [{task.row_start}, {task.row_stop})"
                )
            if row_ids.shape[0] != parts[task.task_id].num_rows:
                raise StoreIntegrityError(f"task {task.task_id}: part record and row_ids disagree")
            stored.append(row_ids)
        got = np.sort(np.concatenate(stored)) if stored else np.zeros(0, dtype=np.int64)
        twice = got[1:][got[1:] == got[:-1]]
        missing = np.setdiff1d(expected, got)
        foreign = np.setdiff1d(got, expected)
        if twice.size or missing.size or foreign.size:
            raise StoreIntegrityError(
                f"teacher {teacher.index}: shards do not cover its rows exactly "
                f"(stored twice: {twice[:5].tolist()}, missing: {missing[:5].tolist()}, "
                f"routed to another teacher: {foreign[:5].tolist()})"
            )


def _artifact(task: TaskSpec, part: PartRecord, part_sha256: str) -> ArtifactRecord:
    stats = dict(
        task_id=part.task_id,
        path=task.path,
        rows=part.num_rows,
        tokens=part.num_tokens,
        bytes=part.bytes,
        hash=part.hash,
        part_sha256=part_sha256,
    )
    if isinstance(task, RowsTask):
        return RowsArtifact(**stats)
    if isinstance(task, HeadTask):
        return HeadArtifact(teacher=task.teacher, **stats)
    if isinstance(task, EncodingTask):
        return EncodingArtifact(teacher=task.teacher, **stats)
    if isinstance(task, ProjectionTask):
        return ProjectionArtifact(teacher=task.teacher, **stats)
    return ShardArtifact(
        teacher=task.teacher,
        shard=task.shard,
        aligned_tokens=part.aligned_tokens,
        alignment=part.alignment,
        **stats,
    )


def required_features(plan: Plan) -> list[str]:
    """What a reader must know to read the store: its encoding, teachers of other tokenizers, rows of
    several teachers."""
    features = [INT8_ROTATED] if plan.storage.encoding == INT8_ROTATED else []
    features += [CROSS_TOKENIZER] if any(t.tokenizer is not None for t in plan.teachers) else []
    return features + ([TEACHER_SETS] if plan.dataset.teacher_sets else [])


def build_manifest(
    root: Location,
    plan: Plan,
    parts: Mapping[str, PartRecord],
    part_hashes: Mapping[str, str],
    *,
    created_by: str,
    volatile: Mapping[str, Any],
) -> Manifest:
    """The manifest of a store whose every task is done; a pure function of the plan and the parts."""
    check_coverage(root, plan, parts)
    artifacts = [_artifact(task, parts[task.task_id], part_hashes[task.task_id]) for task in plan.tasks]
    heads = {}
    for task in plan.tasks:
        if isinstance(task, HeadTask):
            head = parts[task.task_id].head
            if head is None:
                raise StoreIntegrityError(f"part record of {task.task_id} does not describe the LM head")
            heads[task.teacher] = head
    teachers = [TeacherEntry(**t.model_dump(), **heads[t.index].model_dump()) for t in plan.teachers]
    return Manifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        required_features=required_features(plan),
        created_by=created_by,
        identity=plan.identity(),
        tokenizer=plan.tokenizer,
        dataset=plan.dataset,
        teachers=teachers,
        storage=plan.storage,
        rows=next(a for a in artifacts if isinstance(a, RowsArtifact)),
        lm_heads=sorted((a for a in artifacts if isinstance(a, HeadArtifact)), key=lambda a: a.teacher),
        shards=sorted(
            (a for a in artifacts if isinstance(a, ShardArtifact)), key=lambda a: (a.teacher, a.shard)
        ),
        encodings=sorted((a for a in artifacts if isinstance(a, EncodingArtifact)), key=lambda a: a.teacher),
        projections=sorted(
            (a for a in artifacts if isinstance(a, ProjectionArtifact)), key=lambda a: a.teacher
        ),
        config=plan.config,
        volatile=dict(volatile),
    )


def publish_manifest(root: Location, manifest: Manifest) -> tuple[Manifest, bool]:
    """Publishes `manifest` no-clobber. An identical existing manifest means a racing finalize won.

    Returns:
        The store's manifest, and whether this call published it.

    Raises:
        StoreIntegrityError: a different manifest is already there.
    """
    if root.create_exclusive(
        MANIFEST_FILE, canonical_json(manifest.model_dump(mode="json")), what="manifest"
    ):
        return manifest, True
    existing = load_manifest(root)
    if existing.stable_dict() != manifest.stable_dict():
        raise StoreIntegrityError(
            f"{root.describe(MANIFEST_FILE)} already exists and differs from the manifest this job built "
            f"(existing {existing.hash()[:16]}, this job's {manifest.hash()[:16]}); the store was finalized "
            "by another run. Run `mopd verify-manifest` on it, or use a new store path."
        )
    return existing, False
