"""`mopd precompute` into an S3 bucket (a local moto server): N jobs give the store they give on disk,
byte for byte and with the same manifest hash; SIGKILL at random moments and a rerun give it again; two
jobs on one task publish it once; a bucket that ignores conditional writes is refused at open."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from mopd.store.format.loading import load_manifest
from tests.fault_trials import (
    REPO,
    cli,
    kill_at_random,
    precompute_args,
    store_contents,
    two_jobs_at_once,
    two_teacher_config,
)
from tests.mopd_process import MopdProcess
from tests.object_store import S3Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> tuple[Path, Path]:
    """A config (two teachers, 12 rows, 3 rows per task: 8 tasks) and its store on disk."""
    root = tmp_path_factory.mktemp("bucket")
    config = two_teacher_config(root, tiny_teachers)
    on_disk = root / "on-disk.zarr"
    done = cli(precompute_args(config, on_disk))
    assert done.returncode == 0, done.stderr
    return config, on_disk


def jobs(config: Path, store: str, count: int) -> list[subprocess.CompletedProcess[str]]:
    """`count` jobs of one store at once, each its share of the tasks."""
    procs = [
        MopdProcess(
            precompute_args(config, store, "--num-tasks", str(count), "--task-index", str(index)), cwd=REPO
        )
        for index in range(count)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(300), *p.communicate()) for p in procs]


def failures(finished: list[subprocess.CompletedProcess[str]]) -> str:
    """The exit code and the end of the log of each job that failed."""
    return "\n".join(
        f"job {i} exited {job.returncode}:\n{job.stderr[-3000:]}"
        for i, job in enumerate(finished)
        if job.returncode
    )


def test_three_jobs_into_a_bucket_make_the_store_on_disk(setup: tuple[Path, Path], s3_bucket: str) -> None:
    config, on_disk = setup
    store = f"{s3_bucket}/teachers.zarr"
    finished = jobs(config, store, 3)
    assert all(job.returncode == 0 for job in finished), failures(finished)
    assert sum("manifest written" in job.stderr for job in finished) == 1
    # Every object is the file on disk (the tokenised rows stay on the machine that made them: a bucket
    # holds their ingest record only), and the manifests are the same store.
    assert store_contents(store) == store_contents(on_disk, ingest_cache=False)
    assert load_manifest(store).hash() == load_manifest(on_disk).hash()
    verify = cli(["verify-manifest", store, "--full"])
    assert verify.returncode == 0 and verify.stdout.startswith(f"ok: {store}"), verify.stdout + verify.stderr


def test_sigkill_at_ten_random_moments(setup: tuple[Path, Path], s3_bucket: str) -> None:
    """Each trial kills a job at a random moment of its run, then reruns it: the store each time."""
    config, on_disk = setup
    reference = store_contents(on_disk, ingest_cache=False)
    started = time.perf_counter()
    assert cli(precompute_args(config, f"{s3_bucket}/timed.zarr")).returncode == 0
    seconds = time.perf_counter() - started
    rng = random.Random(11)
    outcomes = [
        kill_at_random(config, f"{s3_bucket}/trial-{trial}.zarr", rng, seconds, reference, in_process=True)
        for trial in range(10)
    ]
    assert all(outcome.identical for outcome in outcomes), [o for o in outcomes if not o.identical]


def test_two_jobs_on_every_task_publish_each_once(setup: tuple[Path, Path], s3_bucket: str) -> None:
    config, on_disk = setup
    outcome = two_jobs_at_once(config, f"{s3_bucket}/two.zarr", store_contents(on_disk, ingest_cache=False))
    assert outcome.identical, outcome.detail


def test_a_bucket_without_conditional_writes_is_refused(
    setup: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = setup
    lesser = S3Server(drop_conditions=True)
    try:
        for name, value in lesser.environment().items():
            monkeypatch.setenv(name, value)
        store = f"{lesser.bucket()}/teachers.zarr"
        refused = cli(precompute_args(config, store))
    finally:
        lesser.stop()
    errors: list[Any] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr
    assert errors[0].startswith(f"error: store {store}: the object store accepted a second create-only write")
    assert "ingest:" not in refused.stderr  # refused before any work
