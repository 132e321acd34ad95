"""Acceptance: a task killed before publishing leaves the store incomplete; a rerun completes it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mopd.store import StoreIncompleteError, open_store
from mopd.store.format.manifest import MANIFEST_FILE, PARTS_DIR
from mopd.store.verify import verify_store
from tests.store.synthetic import StoreSpec, build_plan, build_store, hidden_for

REPO = Path(__file__).resolve().parents[2]


def run_writer(spec: StoreSpec, tmp_path: Path) -> subprocess.CompletedProcess:
    spec_file = tmp_path / f"spec-{os.urandom(4).hex()}.json"
    spec_file.write_text(json.dumps(dataclasses.asdict(spec)))
    return subprocess.run(
        [sys.executable, "-m", "tests.store.synthetic", str(spec_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_killed_task_leaves_store_incomplete_and_rerun_completes(
    small_spec: StoreSpec, tmp_path: Path
) -> None:
    spec = dataclasses.replace(small_spec, kill_in_task="teacher_002_shard_000001")
    killed = run_writer(spec, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    root = Path(spec.root)
    # The half-written shard exists only under its temporary name; nothing treats it as complete.
    shards = root / "teachers" / "2" / "shards"
    assert not (shards / "shard_000001").exists()
    assert any(".tmp-" in p.name for p in shards.iterdir())
    assert not (root / MANIFEST_FILE).exists()
    with pytest.raises(StoreIncompleteError, match=r"\d+ of \d+ tasks are done"):
        open_store(root)
    problems, _ = verify_store(root)
    assert len(problems) == 1 and "tasks are done" in problems[0]
    done_before = {p.name for p in (root / PARTS_DIR).iterdir()}

    rerun = run_writer(dataclasses.replace(spec, kill_in_task=None), tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    # The rerun removed the temporary: its owner, a process of this host, no longer runs.
    assert not any(".tmp-" in p.name for p in shards.iterdir())
    store = open_store(root)
    assert verify_store(root, full=True) == ([], [])
    # Finished tasks were kept, not redone: their part records are the same files.
    assert done_before < {p.name for p in (root / PARTS_DIR).iterdir()}
    for i in range(store.num_rows):
        t = store.teacher(store.row(i).teacher_index)
        expected = hidden_for(i, t.index, small_spec.lengths[i], t.hidden_size, torch.float32)
        assert torch.equal(store.hidden(i), expected)


def test_crash_between_publish_and_part_record_is_adopted(small_spec: StoreSpec) -> None:
    build_store(small_spec)
    root = Path(small_spec.root)
    manifest = (root / MANIFEST_FILE).read_bytes()
    # Simulate a job that published its folder and died before creating its part record.
    (root / MANIFEST_FILE).unlink()
    (root / PARTS_DIR / "teacher_001_shard_000000.json").unlink()
    build_store(small_spec)
    assert json.loads((root / MANIFEST_FILE).read_bytes())["identity"] == json.loads(manifest)["identity"]
    assert verify_store(root, full=True) == ([], [])


def test_published_folder_with_other_content_is_refused(small_spec: StoreSpec) -> None:
    from mopd.base.errors import StoreIntegrityError

    build_store(small_spec)
    root = Path(small_spec.root)
    (root / MANIFEST_FILE).unlink()
    (root / PARTS_DIR / "teacher_001_shard_000000.json").unlink()
    offsets = next((root / "teachers" / "1" / "shards" / "shard_000000" / "offsets" / "c").iterdir())
    offsets.write_bytes(offsets.read_bytes() + b"x")
    with pytest.raises(StoreIntegrityError, match="already published with different content"):
        build_store(small_spec)
    assert not (root / MANIFEST_FILE).exists()


def test_two_jobs_split_tasks_and_either_may_finalize(small_spec: StoreSpec) -> None:
    plan, _, _ = build_plan(small_spec)
    ids = [t.task_id for t in plan.tasks]
    first = dataclasses.replace(small_spec, only_tasks=ids[::2])
    second = dataclasses.replace(small_spec, only_tasks=ids[1::2])
    build_store(first)
    assert not (Path(small_spec.root) / MANIFEST_FILE).exists()
    build_store(second)  # completes the last task, so it writes the manifest
    assert verify_store(small_spec.root, full=True) == ([], [])
    build_store(small_spec)  # a racing finalizer with an identical manifest succeeds
    assert open_store(small_spec.root).num_rows == len(small_spec.lengths)


def test_store_of_another_run_is_refused(small_store: StoreSpec) -> None:
    from mopd.base.errors import ManifestError

    other = dataclasses.replace(small_store, lengths=[n + 1 for n in small_store.lengths])
    with pytest.raises(ManifestError, match=r"already holds a store of a different run.*dataset"):
        build_store(other)


def test_rows_carry_teacher_index_per_row(small_store: StoreSpec) -> None:
    store = open_store(small_store.root)
    by_alias = {alias: t.index for t in store.teachers for alias in t.aliases}
    assert np.array_equal(store.teacher_indices, [by_alias[a] for a in small_store.agents])
