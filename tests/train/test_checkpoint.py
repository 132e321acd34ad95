"""Checkpoint publication, retention and the no-pickle rule; `verify-manifest --checkpoint` on a real one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from mopd.base.completion import write_complete
from mopd.base.errors import CheckpointError, ConfigError
from mopd.cli.main import cli
from mopd.store.format.teachers import TEACHER_LIST_FILE
from mopd.train.checkpoint.state import COMPLETE, complete_checkpoints
from mopd.train.trainer import Trainer, run_training
from tests.precompute.teachers import assert_same_chat_tokens
from tests.train.world import World, world_config


def test_checkpoints_hold_safetensors_and_json_only(world: World, tmp_path: Path) -> None:
    result = run_training(world_config(world, tmp_path, steps=2), log=lambda _line: None)
    assert result.checkpoint is not None
    files = {p.relative_to(result.checkpoint).as_posix() for p in result.checkpoint.rglob("*") if p.is_file()}
    assert {"COMPLETE", "state.json", TEACHER_LIST_FILE, "optimizer.safetensors", "rng.safetensors"} <= files
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= files
    assert "model/chat_template.jinja" in files  # the student's chat template, as transformers saves it
    assert all(Path(f).suffix in {".json", ".safetensors", ".jinja", ""} for f in files), files
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
    assert re.search(r"\[(code|math)=\S+ (code|math)=", out.output)  # text, not rich markup
    again = CliRunner().invoke(
        cli, ["train", str(config), "--no-resume", "--output", str(tmp_path / "cli-run")]
    )
    assert again.exit_code == 1 and "already holds checkpoints" in again.output
    assert "Traceback" not in again.output


def test_an_interrupted_train_command_says_how_to_resume(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during step 3 (checkpoints every 2): exit 130 and a line naming the step-2 checkpoint the
    same command resumes from, and how to start over instead; the save of step 2 was a line of its own."""
    world_config(world, tmp_path, steps=4, checkpoint={"every": 2, "keep": 1})
    original = Trainer.train_step

    def interrupted(self: Trainer, step: int, batch: Any) -> Any:
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step, batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    command = ["train", str(tmp_path / "config.yaml")]
    out = CliRunner().invoke(cli, command)
    assert out.exit_code == 130, out.output
    run = tmp_path / "run"
    last = out.stderr.strip().splitlines()[-1]
    kept = run / "checkpoints" / "step_00000002"
    assert last == (
        f"interrupted: the last complete checkpoint is {kept}; the same command resumes from it, or to "
        f"start over give the run another folder (--output DIR) or remove {run}"
    )
    saved = [line for line in out.stderr.splitlines() if line.startswith("saved checkpoint")]
    assert saved == [f"saved checkpoint {kept} (a resume starts after step 2)"]


def test_export_hf_writes_the_trained_student(world: World, tmp_path: Path) -> None:
    """`mopd train --export-hf` and `mopd export-hf RUN` write the last checkpoint's student, which
    reloads with the trained weights; an existing folder and a folder without checkpoints are refused."""
    world_config(world, tmp_path, steps=2)  # writes tmp_path / config.yaml
    trained_run = CliRunner().invoke(
        cli, ["train", str(tmp_path / "config.yaml"), "--export-hf", str(tmp_path / "exported")]
    )
    assert trained_run.exit_code == 0, trained_run.output
    checkpoint = complete_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    again = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "run"), str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    trained = AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    tokens = torch.arange(40).reshape(2, 20) % trained.config.vocab_size
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
    for folder in ("exported", "again"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(model(input_ids=tokens).logits, want)
        assert_same_chat_tokens(tmp_path / folder, world.student)
    original = AutoModelForCausalLM.from_pretrained(world.student, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.equal(original(input_ids=tokens).logits, want)  # training changed the student
    taken = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "run"), str(tmp_path / "again")])
    assert taken.exit_code == 1 and "already exists and is not empty" in taken.output
    empty = CliRunner().invoke(cli, ["export-hf", str(tmp_path), str(tmp_path / "none")])
    assert empty.exit_code == 1 and "neither a complete checkpoint nor a run folder" in empty.output


def test_a_checkpoint_of_another_backend_is_refused(world: World, tmp_path: Path) -> None:
    """An hf checkpoint is not resumed by a megatron student (one process, tp = pp = 1): the layout in
    state.json is checked, and the message names both layouts. An earlier mopd's megatron checkpoint
    (one weights file per slice and stage, its layout recorded as tp × pp) is refused in one line."""
    run_training(world_config(world, tmp_path, steps=2), max_steps=1, log=lambda _line: None)
    folder = tmp_path / "run" / "checkpoints" / "step_00000001"
    state = json.loads((folder / "state.json").read_text())
    assert state["layout"] == {"backend": "hf"}
    megatron = world_config(world, tmp_path, steps=2, backend="megatron", device="cpu")
    with pytest.raises(ConfigError, match=r"written by a hf student, this run is megatron \(any tp × pp\)"):
        run_training(megatron, log=lambda _line: None)
    assert not torch.distributed.is_initialized()  # the one-rank group it made is gone

    (folder / "state.json").write_text(
        json.dumps({**state, "layout": {"backend": "megatron", "tp": 2, "pp": 2}})
    )
    write_complete(folder, {"step": 1})
    earlier = r"one weights file per tensor-parallel slice and pipeline stage .* train that student again"
    with pytest.raises(CheckpointError, match=earlier) as refused:
        run_training(megatron, log=lambda _line: None)
    assert "\n" not in str(refused.value)  # one line


def test_a_student_without_safetensors_weights_is_refused(world: World, tmp_path: Path) -> None:
    """A pickled checkpoint can run code when loaded: the student is read from safetensors only."""
    student = Path(shutil.copytree(world.student, tmp_path / "pickled"))
    from safetensors.torch import load_file

    torch.save(load_file(student / "model.safetensors"), student / "pytorch_model.bin")
    (student / "model.safetensors").unlink()
    with pytest.raises(
        ConfigError, match=r"train.student: .*pickled cannot be loaded .*safetensors weights only"
    ):
        run_training(world_config(world, tmp_path, student=student, steps=1), log=lambda _line: None)
