"""Acceptance: N jobs split the work into a byte-identical store; SIGKILLed runs resume without rework."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from mopd.base.fsio import file_digests, is_temporary
from mopd.store.format.manifest import MANIFEST_FILE, PARTS_DIR
from tests.mopd_process import MopdProcess, run_mopd_process
from tests.precompute.conftest import BACKENDS, four_aliases, write_config
from tests.precompute.teachers import mixed_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def precompute_cmd(config: Path, store: Path, *args: str) -> list[str]:
    return ["precompute", str(config), "--store", str(store), *args]


def run(cmd: list[str]) -> str:
    proc = run_mopd_process(cmd, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def store_contents(store: Path) -> dict[str, tuple[int, str]]:
    """Every file's digest, temporaries left out; the manifest without its volatile fields."""
    digests = {
        path: value
        for path, value in file_digests(store).items()
        if not any(is_temporary(part) for part in path.split("/")) and path != MANIFEST_FILE
    }
    manifest = json.loads((store / MANIFEST_FILE).read_text())
    manifest.pop("volatile")
    digests[MANIFEST_FILE] = (0, json.dumps(manifest, sort_keys=True))
    return digests


@pytest.fixture(scope="module", params=BACKENDS)
def one_job(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]
) -> tuple[Path, Path]:
    """A config over 40 rows, 2 rows a task, on each backend, and the store one uninterrupted job makes of
    it (the reference of both tests: one run per backend, not one per test)."""
    root = tmp_path_factory.mktemp(f"jobs-{request.param}")
    data = write_jsonl(root / "train.jsonl", mixed_records(40))
    precompute = {"rows_per_task": 2, "backend": request.param}
    config = write_config(root, four_aliases(tiny_teachers), data=data, precompute=precompute)
    run(precompute_cmd(config, root / "single.zarr"))
    return config, root / "single.zarr"


def test_three_jobs_in_any_order_equal_one_job(one_job: tuple[Path, Path], tmp_path: Path) -> None:
    job_config, single = one_job
    split = tmp_path / "split.zarr"
    for index in (2, 0, 1):
        log = run(precompute_cmd(job_config, split, "--num-tasks", "3", "--task-index", str(index)))
        finalized = (split / MANIFEST_FILE).exists()
        assert finalized == (index == 1), log  # the job that completes the last task writes the manifest
        # The first job tokenises and publishes the rows; the others read them (ingest once).
        assert ("ingest: tokenised" in log) == (index == 2), log
        assert ("ingest: reading the tokenised rows" in log) == (index != 2), log
    # Every file equal, the shared ingest cache (STORE/ingest/<key>/) included.
    assert store_contents(split) == store_contents(single)
    assert any(path.startswith("ingest/") for path in store_contents(split))
    assert len(store_contents(single)) > 100


def test_sigkill_at_random_points_then_resume(one_job: tuple[Path, Path], tmp_path: Path) -> None:
    job_config, reference = one_job
    total = len(list((reference / PARTS_DIR).glob("*.json")))
    store = tmp_path / "killed.zarr"
    rng = random.Random(1234)
    kill_points = sorted(rng.sample(range(1, total - 3), 3))
    for k in kill_points:
        proc = MopdProcess(precompute_cmd(job_config, store), cwd=REPO)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            parts = store / PARTS_DIR
            if parts.exists() and len(list(parts.glob("*.json"))) >= k:
                time.sleep(rng.uniform(0.0, 0.02))
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        assert proc.wait(timeout=30) == -signal.SIGKILL, "the run ended before it could be killed"
        assert not (store / MANIFEST_FILE).exists()
    done_before = len(list((store / PARTS_DIR).glob("*.json")))
    assert done_before >= kill_points[-1]
    log = run(precompute_cmd(job_config, store))
    computed, skipped = map(int, re.search(r"computed (\d+) tasks, skipped (\d+) already done", log).groups())
    assert (computed, skipped) == (total - done_before, done_before)  # finished tasks were not redone
    assert store_contents(store) == store_contents(reference)
