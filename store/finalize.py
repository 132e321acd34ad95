"""Finalize: prove exact row coverage, build the deterministic manifest, publish it no-clobber."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mopd.store.arrays import open_array, read_rows
from mopd.store.errors import StoreIntegrityError
from mopd.store.fsio import create_exclusive, safe_join
from mopd.store.manifest import (
    FORMAT,
    FORMAT_VERSION,
    ArtifactRecord,
    Manifest,
    PartRecord,
    Plan,
    TeacherEntry,
    canonical_json,
    load_manifest,
)


def check_coverage(root: Path, plan: Plan, parts: Mapping[str, PartRecord]) -> None:
    """Every row of teacher i is in exactly one of teacher i's shards, within its task's row range.

    Raises:
        StoreIntegrityError: naming the teacher and the first rows missing or stored twice.
    """
    rows_task = next(t for t in plan.tasks if t.kind == "rows")
    teacher_index = read_rows(open_array(safe_join(root, rows_task.path) / "teacher_index"))
    if teacher_index.shape[0] != plan.dataset.num_rows:
        raise StoreIntegrityError(
            f"rows hold {teacher_index.shape[0]} rows, the plan has {plan.dataset.num_rows}"
        )
    for teacher in plan.teachers:
        expected = np.flatnonzero(teacher_index == teacher.index)
        stored = []
        for task in plan.tasks:
            if task.kind != "hidden" or task.teacher != teacher.index:
                continue
            row_ids = read_rows(open_array(safe_join(root, task.path) / "row_ids"))
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


def _artifact(part: PartRecord, part_sha256: str) -> ArtifactRecord:
    return ArtifactRecord(
        task_id=part.task_id,
        kind=part.kind,
        path=part.path,
        teacher=part.teacher,
        shard=part.shard,
        rows=part.num_rows,
        tokens=part.num_tokens,
        bytes=part.bytes,
        hash=part.hash,
        part_sha256=part_sha256,
    )


def build_manifest(
    root: Path,
    plan: Plan,
    parts: Mapping[str, PartRecord],
    part_hashes: Mapping[str, str],
    *,
    created_by: str,
    volatile: Mapping[str, Any],
) -> Manifest:
    """The manifest of a store whose every task is done; a pure function of the plan and the parts."""
    check_coverage(root, plan, parts)
    by_kind: dict[str, list[ArtifactRecord]] = {"rows": [], "lm_head": [], "hidden": []}
    for task in plan.tasks:
        by_kind[task.kind].append(_artifact(parts[task.task_id], part_hashes[task.task_id]))
    heads = {part.teacher: part.info for part in parts.values() if part.kind == "lm_head"}
    teachers = [TeacherEntry(**teacher.model_dump(), **heads[teacher.index]) for teacher in plan.teachers]
    return Manifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        required_features=[],
        created_by=created_by,
        identity=plan.identity(),
        tokenizer=plan.tokenizer,
        dataset=plan.dataset,
        teachers=teachers,
        storage=plan.storage,
        rows=by_kind["rows"][0],
        lm_heads=sorted(by_kind["lm_head"], key=lambda a: a.teacher or 0),
        shards=sorted(by_kind["hidden"], key=lambda a: (a.teacher or 0, a.shard or 0)),
        config=plan.config,
        volatile=dict(volatile),
    )


def publish_manifest(path: Path, manifest: Manifest) -> Manifest:
    """Publishes `manifest` no-clobber. An identical existing manifest means a racing finalize won.

    Raises:
        StoreIntegrityError: a different manifest is already there.
    """
    if create_exclusive(path, canonical_json(manifest.model_dump(mode="json"))):
        return manifest
    existing = load_manifest(path)
    if existing.stable_dict() != manifest.stable_dict():
        raise StoreIntegrityError(
            f"{path} already exists and differs from the manifest this job built; the store was finalized "
            "by another run. Run `mopd verify-manifest` on it, or use a new store path."
        )
    return existing
