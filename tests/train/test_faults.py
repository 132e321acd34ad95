"""Faults in training are tested, not assumed: a `mopd train` SIGKILLed at a random step, inside a
checkpoint save, or twice in a row resumes to the uninterrupted run's losses and gradient norms bit for
bit, with every step once in metrics.jsonl and no temporary left; an ENOSPC or EIO in a checkpoint save
stops the run with one line, keeps the previous checkpoint intact and publishes nothing partial.
(`scripts/fault-trials` runs these trials many more times.)"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.fault_trials import (
    cli,
    compare_runs,
    io_error_in_checkpoint,
    kill_training,
    resume,
    train_in_process,
    train_records,
)
from tests.small_fs import folder_bytes, full_disk_error, small_filesystem
from tests.train.world import World, world_config

pytestmark = pytest.mark.slow
TRAIN = dict(steps=6, checkpoint={"every": 2, "keep": 2})


@pytest.fixture(scope="module")
def reference(world: World, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The config and the uninterrupted run's training records (a process of its own, like the trials)."""
    root = tmp_path_factory.mktemp("train-faults")
    world_config(world, root, **TRAIN)
    done = cli(["train", str(root / "config.yaml"), "--output", str(root / "whole")])
    assert done.returncode == 0, done.stderr
    return root / "config.yaml", train_records(root / "whole")


@pytest.mark.parametrize(
    "kills",
    [["step:3"], ["checkpoint-written:2"], ["step:1", "checkpoint-renamed:1"]],
    ids=["random-step", "inside-a-save", "twice"],
)
def test_killed_runs_resume_bit_identically(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path, kills: list[str]
) -> None:
    config, whole = reference
    run = tmp_path / "run"
    for when in kills:
        assert kill_training(config, run, when=when, rng=random.Random(len(kills))) == -9, when
    done = resume(config, run)
    assert done.returncode == 0, done.stderr
    outcome = compare_runs("+".join(kills), run, whole)
    assert outcome.identical, outcome.detail


@pytest.mark.parametrize("op", ["write", "fsync", "rename"])
@pytest.mark.parametrize("code", ["enospc", "eio"])
def test_io_errors_in_a_checkpoint_save(world: World, tmp_path: Path, op: str, code: str) -> None:
    """The k-th operation of the saves fails (k = 2 here, 1..5 in scripts/fault-trials): one line naming
    the operation and the path, exit 1; the checkpoint before is intact and nothing partial is
    published; resumed without the fault, the run ends as the uninterrupted one."""
    config = tmp_path / "config.yaml"
    world_config(world, tmp_path, **TRAIN)
    assert train_in_process(config, tmp_path / "whole")[0] == 0
    whole = train_records(tmp_path / "whole")
    outcome = io_error_in_checkpoint(config, tmp_path / "run", code, op, 2, whole)
    assert outcome.identical, outcome


def test_a_full_disk_inside_a_checkpoint_write_is_one_line(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A real full disk: the run's output on a tmpfs that holds one checkpoint and half of the next, so
    the step-4 save fails inside safetensors' own write (an error safetensors wraps, not an OSError):
    one line naming the file and the space left, exit 1; the step-2 checkpoint intact and nothing
    partial published; given room again, the run resumes to the uninterrupted run's records. Where no
    tmpfs can be mounted the same failure is injected at the save's second write."""
    from mopd.base.completion import check_complete
    from mopd.train.checkpoint.state import complete_checkpoints

    config, whole = reference
    checkpoint = folder_bytes(complete_checkpoints(config.parent / "whole" / "checkpoints")[0])
    rest = folder_bytes(config.parent / "whole") - folder_bytes(config.parent / "whole" / "checkpoints")
    run = tmp_path / "run"
    with small_filesystem(run, rest + checkpoint * 3 // 2) as disk:
        if disk is None:
            outcome = io_error_in_checkpoint(config, run, "enospc", "write", 2, whole)
            assert outcome.identical, outcome
            return
        error = full_disk_error(*train_in_process(config, run))
        assert "step_00000004.tmp-" in error and "optimizer.safetensors" in error, error
        checkpoints = complete_checkpoints(run / "checkpoints")
        assert [c.name for c in checkpoints] == ["step_00000002"]
        assert check_complete(checkpoints[0]) == []
        disk.grow(64 << 20)
        assert train_in_process(config, run)[0] == 0
        outcome = compare_runs("full disk", run, whole)
        assert outcome.identical, outcome.detail
