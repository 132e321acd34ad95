"""Faults in precompute's commit path are tested, not assumed: SIGKILL at every named point and at random
moments, two jobs on one task, racing finalizers, ENOSPC and EIO at the k-th write, fsync, rename and
link. After each, a rerun gives the uninterrupted run's store, file for file. (`scripts/fault-trials`
runs the same trials many more times.)"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from mopd.store.format.manifest import MANIFEST_FILE
from tests.fault_trials import (
    PRECOMPUTE_POINTS,
    cli,
    finish_and_compare,
    io_error_in_precompute,
    kill_at_random,
    precompute_args,
    precompute_in_process,
    racing_finalizers,
    store_contents,
    two_jobs_at_once,
    two_teacher_config,
)
from tests.small_fs import full_disk_error, small_filesystem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]
) -> tuple[Path, dict[str, Any], float]:
    """A config (two teachers, 12 rows, 3 rows per task: 8 tasks), its uninterrupted store, and how
    long that run took (the span random kills are drawn from)."""
    root = tmp_path_factory.mktemp("faults")
    config = two_teacher_config(root, tiny_teachers)
    reference = root / "reference.zarr"
    started = time.perf_counter()
    done = cli(precompute_args(config, reference))
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    return config, store_contents(reference), seconds


def test_sigkill_at_every_commit_point(setup: tuple[Path, dict[str, Any], float], tmp_path: Path) -> None:
    """One store killed at each point in turn (a task's second pass through task points, so that one
    task is already done); nothing looks finished before the manifest, then a rerun finishes it."""
    config, reference, _ = setup
    store = tmp_path / "store.zarr"
    for point in PRECOMPUTE_POINTS:
        k = 2 if point.startswith(("task", "part")) else 1
        killed = cli(precompute_args(config, store), fault=f"kill@{point}:{k}")
        assert killed.returncode == -9, (point, killed.stderr[-500:])
        assert (store / MANIFEST_FILE).exists() == (point == "manifest-linked"), point
    outcome = finish_and_compare("every point", config, store, reference)
    assert outcome.identical, outcome.detail


def test_sigkill_at_random_moments(setup: tuple[Path, dict[str, Any], float], tmp_path: Path) -> None:
    config, reference, seconds = setup
    rng = random.Random(7)
    for trial in range(2):
        outcome = kill_at_random(config, tmp_path / f"store-{trial}.zarr", rng, seconds, reference)
        assert outcome.identical, outcome


def test_two_jobs_on_one_task_and_racing_finalizers(
    setup: tuple[Path, dict[str, Any], float], tmp_path: Path
) -> None:
    config, reference, _ = setup
    assert two_jobs_at_once(config, tmp_path / "two.zarr", reference).identical
    assert racing_finalizers(config, tmp_path / "race.zarr", reference).identical


def test_a_different_existing_manifest_is_an_error_naming_both_hashes(
    setup: tuple[Path, dict[str, Any], float], tmp_path: Path
) -> None:
    config, _, _ = setup
    store = tmp_path / "store.zarr"
    assert cli(precompute_args(config, store), fault="kill@manifest-written").returncode == -9
    other = tmp_path / "other.zarr"
    assert cli(precompute_args(config, other)).returncode == 0
    text = (other / MANIFEST_FILE).read_text().replace('"created_by": "mopd', '"created_by": "another mopd')
    (store / MANIFEST_FILE).write_text(text)
    result = cli(precompute_args(config, store))
    assert result.returncode == 1
    error = " ".join(result.stderr.split())
    assert "already exists and differs from the manifest this job built (existing " in error
    assert error.count("error: ") == 1 and "Traceback" not in error


@pytest.mark.parametrize("op", ["write", "fsync", "rename", "link"])
@pytest.mark.parametrize("code", ["enospc", "eio"])
def test_io_errors_stop_cleanly_and_a_rerun_completes(
    setup: tuple[Path, dict[str, Any], float], tmp_path: Path, op: str, code: str
) -> None:
    """The k-th operation fails (k = 1 and 4 here; 1..5 in scripts/fault-trials): one line naming the
    operation and the path, exit 1, no temporary left and no manifest; every folder that did get
    published is complete; a rerun without the fault gives the reference store."""
    config, reference, _ = setup
    for k in (1, 4):
        outcome = io_error_in_precompute(config, tmp_path / f"store-{k}.zarr", code, op, k, reference)
        assert outcome.identical, outcome


def _pages(folder: Path) -> int:
    """Bytes the files below `folder` take on a tmpfs: whole 4 KiB pages each."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["ingest", "task"])
def test_a_real_full_disk_is_one_line_naming_the_file(
    setup: tuple[Path, dict[str, Any], float], tmp_path: Path, where: str
) -> None:
    """The store on a tmpfs that holds half of the ingest cache, or the cache and half of the store:
    the write that finds the disk full, a buffered one inside datasets' map or zarr's shard included,
    is one line naming its file and the space left, exit 1; with room again a rerun gives the reference
    store. Where no tmpfs can be mounted the same failure is injected at the first write."""
    config, reference, _ = setup
    cached = _pages(config.parent / "reference.zarr" / "ingest")
    size = cached // 2 if where == "ingest" else cached + _pages(config.parent / "reference.zarr") // 2
    store = tmp_path / "disk" / "store.zarr"
    with small_filesystem(tmp_path / "disk", max(4096, size)) as disk:
        if disk is None:
            outcome = io_error_in_precompute(config, store, "enospc", "write", 1, reference)
            assert outcome.identical, outcome
            return
        error = full_disk_error(*precompute_in_process(config, store))
        assert error.startswith(f"error: write failed: No space left on device: {store}/"), error
        assert ("/ingest/" in error) == (where == "ingest"), error
        disk.grow(64 << 20)
        outcome = finish_and_compare(where, config, store, reference, in_process=True)
        assert outcome.identical, outcome.detail


def test_a_damaged_manifest_says_how_to_rebuild_it_and_that_rebuilds_it(
    setup: tuple[Path, dict[str, Any], float], tmp_path: Path
) -> None:
    """A truncated manifest: readers say to delete it and rerun precompute; doing so rebuilds the same
    manifest from the part records, computing nothing again."""
    import shutil

    from mopd.store.format.loading import load_manifest

    config, reference, _ = setup
    store = Path(shutil.copytree(config.parent / "reference.zarr", tmp_path / "store.zarr"))
    manifest = store / MANIFEST_FILE
    original = load_manifest(store)
    manifest.write_bytes(manifest.read_bytes()[:100])
    verify = cli(["verify-manifest", str(store)])
    assert (
        verify.returncode == 1 and "it is damaged; delete it and run `mopd precompute` again" in verify.stdout
    )
    manifest.unlink()
    code, stderr = precompute_in_process(config, store)
    assert code == 0 and "computed 0 tasks" in stderr, stderr
    assert load_manifest(store).stable_dict() == original.stable_dict()
    assert store_contents(store) == reference
