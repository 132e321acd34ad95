"""Checkpoint publication, retention and the no-pickle rule; `verify-manifest --checkpoint` on a real one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.store.teachers import TEACHER_LIST_FILE
from mopd.train.checkpoint import COMPLETE, complete_checkpoints
from mopd.train.trainer import run_training
from tests.train.world import World, world_config


def test_checkpoints_hold_safetensors_and_json_only(world: World, tmp_path: Path) -> None:
    result = run_training(world_config(world, tmp_path, steps=2), log=lambda _line: None)
    assert result.checkpoint is not None
    files = {p.relative_to(result.checkpoint).as_posix() for p in result.checkpoint.rglob("*") if p.is_file()}
    assert {"COMPLETE", "state.json", TEACHER_LIST_FILE, "optimizer.safetensors", "rng.safetensors"} <= files
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= files
    assert all(Path(f).suffix in {".json", ".safetensors", ""} for f in files), files
    state = json.loads((result.checkpoint / "state.json").read_text())
    assert state["step"] == 2 and state["loader"]["seed"] == 0


def test_an_unmarked_checkpoint_is_not_resumed_from(world: World, tmp_path: Path) -> None:
    config = world_config(world, tmp_path, steps=4, checkpoint={"every": 1, "keep": 5})
    run_training(config, max_steps=2, log=lambda _line: None)
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000002" / COMPLETE).unlink()  # as if the run died while writing it
    shutil.copytree(root / "step_00000001", root / "step_00000003.tmp-deadbeef")
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000001"]
    resumed = run_training(config, log=lambda _line: None)
    assert resumed.first_step == 2


def test_retention_keeps_the_newest_checkpoints(world: World, tmp_path: Path) -> None:
    run_training(
        world_config(world, tmp_path, steps=5, checkpoint={"every": 1, "keep": 2}), log=lambda _l: None
    )
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000004", "step_00000005"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000005"]


def test_verify_manifest_checks_a_training_checkpoint(world: World, tmp_path: Path) -> None:
    result = run_training(world_config(world, tmp_path, steps=1), log=lambda _line: None)
    assert result.checkpoint is not None
    ok = CliRunner().invoke(
        cli, ["verify-manifest", str(world.store), "--checkpoint", str(result.checkpoint)]
    )
    assert ok.exit_code == 0, ok.output
    teachers = json.loads((result.checkpoint / TEACHER_LIST_FILE).read_text())
    teachers["teachers"].pop()
    (result.checkpoint / TEACHER_LIST_FILE).write_text(json.dumps(teachers))
    bad = CliRunner().invoke(
        cli, ["verify-manifest", str(world.store), "--checkpoint", str(result.checkpoint)]
    )
    assert bad.exit_code == 1 and "dropped from the checkpoint" in bad.output


def test_train_command(world: World, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    world_config(world, tmp_path, steps=3)
    out = CliRunner().invoke(
        cli, ["train", str(config), "--max-steps", "2", "--output", str(tmp_path / "cli-run")]
    )
    assert out.exit_code == 0, out.output
    assert "step 2/3" in out.output and "step 3/3" not in out.output
    assert "[t0=" in out.output  # the per-teacher part of the step line is text, not rich markup
    again = CliRunner().invoke(
        cli, ["train", str(config), "--no-resume", "--output", str(tmp_path / "cli-run")]
    )
    assert again.exit_code == 1 and "already holds checkpoints" in again.output
    assert "Traceback" not in again.output
