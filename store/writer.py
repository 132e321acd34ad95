"""Writing a store: N jobs publish disjoint task folders, then one finalize (DESIGN §4).

A task writes its folder in a workspace of its own, publishes it under its final name (a folder's rename,
which never lands on an existing one; a bucket's create-only uploads: `locations/`) and only then
creates its part record with no-clobber semantics. A job that finds a task's folder already published (a
requeue, a duplicated array index) compares content instead of adopting blindly. Readers trust only the
manifest, so a half-written task is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from mopd.base import faults
from mopd.base.errors import ManifestError, StoreIntegrityError
from mopd.base.fsio import file_digests, safe_relative
from mopd.store.arrays.write import ArrayAppender, create_array, write_array, write_strings
from mopd.store.finalize import build_manifest, publish_manifest
from mopd.store.format.layout import ArraySpec
from mopd.store.format.loading import load_part, load_plan, part_key, read_record
from mopd.store.format.manifest import (
    PARTS_DIR,
    PLAN_FILE,
    AlignmentCounts,
    HeadInfo,
    HeadTask,
    Manifest,
    PartRecord,
    Plan,
    TaskSpec,
    artifact_hash,
    canonical_json,
    parse_part,
)
from mopd.store.locations.location import Location, open_location
from mopd.store.temporaries import remove_stopped

_GROUP_JSON = canonical_json({"attributes": {}, "node_type": "group", "zarr_format": 3})


class TaskOutput:
    """The temporary folder of one running task and the arrays written into it."""

    def __init__(self, spec: TaskSpec, folder: Path, storage: Any) -> None:
        self.spec = spec
        self.folder = folder
        self.num_rows = 0
        self.num_tokens = 0
        self.aligned_tokens = 0  # a shard of a teacher of another tokenizer: its alignment's positions
        self.alignment: AlignmentCounts | None = None  # and its trained positions' counts
        self.head: HeadInfo | None = None  # what an LM-head task measured of its teacher
        self._chunk_bytes = storage.chunk_bytes
        self._codec = storage.codec
        self._checksum = storage.checksum is not None
        self._appenders: list[ArrayAppender] = []

    def _array_path(self, array: ArraySpec) -> Path:
        return self.folder / array.name if array.name else self.folder

    def appender(self, array: ArraySpec, *, attributes: dict[str, Any] | None = None) -> ArrayAppender:
        """Creates `array` and returns its streaming writer."""
        appender = create_array(
            self._array_path(array),
            shape=array.shape,
            dtype=array.dtype,
            chunk_bytes=self._chunk_bytes,
            codec=self._codec,
            checksum=self._checksum,
            attributes=attributes,
        )
        self._appenders.append(appender)
        return appender

    def write(self, array: ArraySpec, data: np.ndarray) -> None:
        """Creates `array` holding `data` (small arrays; big ones use `appender`)."""
        if data.shape != array.shape or data.dtype != np.dtype(array.dtype):
            raise ValueError(
                f"{array.name}: got {data.dtype}{list(data.shape)}, the layout says "
                f"{array.dtype}{list(array.shape)}"
            )
        write_array(
            self._array_path(array),
            data,
            chunk_bytes=self._chunk_bytes,
            codec=self._codec,
            checksum=self._checksum,
        )

    def write_strings(self, array: ArraySpec, values: list[str]) -> None:
        if (len(values),) != array.shape:
            raise ValueError(f"{array.name}: {len(values)} strings, the layout says {array.shape[0]}")
        write_strings(self._array_path(array), values, checksum=self._checksum)

    def close(self) -> None:
        for appender in self._appenders:
            appender.close()


class StoreWriter:
    """A store opened for writing by one job; several jobs may hold one on the same store at once."""

    def __init__(self, location: Location, plan: Plan) -> None:
        self.location = location
        self.root = location.url
        self.plan = plan
        self.identity = plan.identity()
        self._tasks = {task.task_id: task for task in plan.tasks}
        self.published = False  # whether this writer's finalize published the manifest (not a racing one)
        self.removed: list[str] = []  # temporaries of stopped jobs removed on opening

    @classmethod
    def open(
        cls, root: str | Path | Location, plan: Plan, options: dict[str, str] | None = None
    ) -> StoreWriter:
        """Creates the store, or joins it if it was created with the same plan.

        Args:
            root: a folder, an object-storage URL (`options`: its client's settings) or a `Location`.

        Raises:
            ManifestError: the path holds a store of another dataset, teacher set or config.
            FilesystemError: the filesystem or bucket cannot give the commit protocol's guarantees.
        """
        location = open_location(root, options)
        location.prepare()
        writer = cls(location, plan)
        if not location.create_exclusive(PLAN_FILE, canonical_json(plan.model_dump(mode="json"))):
            existing = load_plan(location)
            if existing.identity() != writer.identity:
                raise ManifestError(_describe_plan_mismatch(location.url, existing, plan))
        writer._create_groups()
        writer.removed = remove_stopped(location, (task.path for task in plan.tasks))
        return writer

    def _create_groups(self) -> None:
        # Every version of a group's zarr.json is identical, so concurrent jobs may each write it.
        folders = {parent for task in self.plan.tasks for parent in Path(task.path).parents}
        for folder in sorted(folders):
            key = "zarr.json" if folder == Path(".") else f"{folder.as_posix()}/zarr.json"
            self.location.write_same(key, _GROUP_JSON)

    def part_path(self, task_id: str) -> str:
        """Where messages say a task's part record is."""
        return self.location.describe(part_key(task_id))

    def done_tasks(self) -> set[str]:
        """Ids of tasks whose part record exists (each checked to belong to this plan)."""
        listed = {name.removesuffix(".json") for name in self.location.names(PARTS_DIR)}
        done = set()
        for task_id in self._tasks:
            if task_id in listed:
                self._check_part(load_part(self.location, task_id), self.part_path(task_id))
                done.add(task_id)
        return done

    def _check_part(self, part: PartRecord, path: str) -> None:
        if part.identity != self.identity:
            raise ManifestError(
                f"{path} was written for another plan (identity {part.identity[:12]}, this job's is "
                f"{self.identity[:12]}); the store at {self.root} belongs to a different run"
            )

    @contextmanager
    def task(self, task_id: str, *, adopt: bool = False) -> Iterator[TaskOutput]:
        """Runs one task: yields its temporary output; on success publishes it and records the part.

        On an exception the temporary folder (owned by this call alone) is removed and nothing is
        published. With `adopt`, a folder another job published first is taken whatever it holds (a
        fitted encoding: any job's fit is valid, but every job must use the same one), and the caller
        reads it back.
        """
        spec = self._tasks[task_id]
        final = safe_relative(spec.path)
        temp = self.location.workspace(final)
        output = TaskOutput(spec, temp, self.plan.storage)
        try:
            yield output
            output.close()
            if not isinstance(spec, HeadTask):  # a head's folder is an array, the others are groups
                (temp / "zarr.json").write_bytes(_GROUP_JSON)
            faults.point("task-written")
            files = file_digests(temp)
            published = self.location.publish(temp, final, what="task", record=part_key(spec.task_id))
        except BaseException:
            # The workspace is this call's alone, and publishing either happened or did not: safe to remove.
            self.location.discard(temp)
            raise
        self._record(output, files, published, final, adopt)

    def _record(
        self, output: TaskOutput, files: dict[str, tuple[int, str]], published: bool, final: str, adopt: bool
    ) -> None:
        spec, temp = output.spec, output.folder
        if not published and adopt:
            files = self.location.digests(final)
            self.location.discard(temp)
        elif not published:
            # Another job published this task first. Same bytes: adopt its folder. Otherwise refuse,
            # and leave both folders for a person to inspect (never clean up on doubt).
            if self.location.digests(final) != files:
                kept = f" (left {temp} for inspection)" if temp.exists() else ""
                raise StoreIntegrityError(
                    f"task {spec.task_id}: {self.location.describe(final)} is already published with "
                    f"different content than this job computed{kept}; if no other job is writing this "
                    "store, remove both and rerun"
                )
            self.location.discard(temp)
        part = PartRecord(
            task_id=spec.task_id,
            identity=self.identity,
            num_rows=output.num_rows,
            num_tokens=output.num_tokens,
            bytes=sum(size for size, _ in files.values()),
            hash=artifact_hash(files),
            files=files,
            head=output.head,
            aligned_tokens=output.aligned_tokens,
            alignment=output.alignment,
        )
        path = self.part_path(spec.task_id)
        record = canonical_json(part.model_dump(mode="json"))
        if not self.location.create_exclusive(part_key(spec.task_id), record, what="part"):
            existing = load_part(self.location, spec.task_id)
            self._check_part(existing, path)
            if existing.hash != part.hash:
                raise StoreIntegrityError(f"{path} records hash {existing.hash}, this job wrote {part.hash}")

    def finalize(self, *, created_by: str, volatile: Mapping[str, Any]) -> Manifest | None:
        """Writes the manifest if every task is done; returns it, or None while tasks remain.

        Raises:
            StoreIntegrityError: rows are covered twice or not at all, or another manifest exists.
        """
        if self.done_tasks() != set(self._tasks):
            return None
        records = {
            task_id: read_record(self.location, part_key(task_id), "part record") for task_id in self._tasks
        }
        parts = {task_id: parse_part(data, self.part_path(task_id)) for task_id, data in records.items()}
        part_hashes = {task_id: hashlib.sha256(data).hexdigest() for task_id, data in records.items()}
        manifest = build_manifest(
            self.location, self.plan, parts, part_hashes, created_by=created_by, volatile=volatile
        )
        manifest, self.published = publish_manifest(self.location, manifest)
        return manifest


def _describe_plan_mismatch(root: str, existing: Plan, new: Plan) -> str:
    differences = []
    if existing.dataset != new.dataset:
        differences.append(
            f"dataset {existing.dataset.source} ({existing.dataset.num_rows} rows) vs "
            f"{new.dataset.source} ({new.dataset.num_rows} rows)"
        )
    old_teachers = {t.checkpoint: t for t in existing.teachers}
    for teacher in new.teachers:
        old = old_teachers.get(teacher.checkpoint)
        if old is not None and old.fingerprint != teacher.fingerprint:
            differences.append(
                f"teacher {', '.join(teacher.aliases)} ({teacher.checkpoint}) changed since the store was "
                f"started: fingerprint {old.fingerprint} in the store, {teacher.fingerprint} now — restore "
                "that checkpoint, or start a new store"
            )
    if sorted(old_teachers) != sorted(t.checkpoint for t in new.teachers):
        differences.append(f"teachers {sorted(old_teachers)} vs {sorted(t.checkpoint for t in new.teachers)}")
    old_backends = sorted({t.backend for t in existing.teachers})
    new_backends = sorted({t.backend for t in new.teachers})
    if old_backends != new_backends:
        differences.append(
            f"teacher backend {', '.join(old_backends)} vs {', '.join(new_backends)}: a store is built "
            "with one backend throughout"
        )
    old_encoding, new_encoding = existing.storage.encoding, new.storage.encoding
    if old_encoding != new_encoding:
        differences.append(
            f"store.encoding {old_encoding} in the store, {new_encoding} in this job's config: a store's "
            f"encoding is fixed by its first job; set store.encoding: {old_encoding} to finish it"
        )
    same_storage = existing.storage.model_copy(update={"encoding": new_encoding}) == new.storage
    if not same_storage or existing.config != new.config:
        differences.append("precompute or storage settings")
    if existing.tokenizer != new.tokenizer:
        differences.append("tokenizer")
    if existing.tasks != new.tasks and not differences:
        differences.append("task split")
    return (
        f"{root} already holds a store of a different run ({'; '.join(differences) or 'plan'}); "
        "choose another store.path or delete the old store"
    )
