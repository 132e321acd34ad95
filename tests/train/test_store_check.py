"""`mopd train` checks its store against its config before step 1: teachers, aliases and routing that
differ are refused naming the key and both values; data settings that differ are one warning line."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.train.trainer import run_training
from tests.train.world import World, world_config, write_train_config

# A one-step run with warmup would be warned of (its rate never reaches lr); these tests count warnings.
NO_WARMUP = {"lr": 5.0e-3, "warmup_steps": 0}


def train_command(config_path: Path) -> tuple[int, str]:
    out = CliRunner().invoke(cli, ["train", str(config_path), "--max-steps", "1"])
    return out.exit_code, out.output


def test_a_teacher_of_other_weights_is_refused(world: World, tmp_path: Path) -> None:
    """teachers.code names another checkpoint (the student's, of the same vocabulary) after precompute."""
    world_config(world, tmp_path, teachers={**world.teachers, "code": world.student}, steps=1)
    code, output = train_command(tmp_path / "config.yaml")
    assert code == 1, output
    assert "precomputed for other teachers or routing than this config" in output
    assert str(world.student) in output and str(world.teachers["code"]) in output  # both values
    assert "Traceback" not in output and not (tmp_path / "run" / "checkpoints").exists()


def test_swapped_aliases_are_refused(world: World, tmp_path: Path) -> None:
    swapped = {"math": world.teachers["code"], "code": world.teachers["math"]}
    world_config(world, tmp_path, teachers=swapped, steps=1)
    code, output = train_command(tmp_path / "config.yaml")
    assert code == 1, output
    assert f"alias math names teacher 1 ({world.teachers['math']}) in the store" in output


def test_other_routing_is_refused_by_train_and_verify_manifest(world: World, tmp_path: Path) -> None:
    world_config(world, tmp_path, routing={"teacher_by_agent": {"math": "math", "code": "math"}}, steps=1)
    code, output = train_command(tmp_path / "config.yaml")
    assert code == 1, output
    line = (
        "routing.teacher_by_agent.code: teacher 0 (alias 'code') in the store, teacher 1 (alias 'math') in "
        "the config"
    )
    assert line in output
    verify = CliRunner().invoke(
        cli, ["verify-manifest", str(world.store), "--config", str(tmp_path / "config.yaml")]
    )
    assert verify.exit_code == 1 and line in verify.output


def test_renamed_aliases_with_their_routing_still_train(world: World, tmp_path: Path) -> None:
    """Aliases are names: `maths`/`coding` routed as `math`/`code` were is the same store."""
    renamed = {"maths": world.teachers["math"], "coding": world.teachers["code"]}
    routing = {"teacher_by_agent": {"math": "maths", "code": "coding"}}
    lines: list[str] = []
    config = world_config(world, tmp_path, teachers=renamed, routing=routing, steps=1, optim=NO_WARMUP)
    assert run_training(config, log=lines.append).last_step == 1
    assert not [line for line in lines if line.startswith("warning")]


def test_other_data_settings_warn_once_and_train_the_store(world: World, tmp_path: Path) -> None:
    other = Path(shutil.copy(world.data, tmp_path / "other.jsonl"))
    world_config(world, tmp_path, steps=1, optim=NO_WARMUP)  # writes tmp_path / config.yaml
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    raw["data"] = {"path": str(other), "max_length": 64}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    result = run_training(load_config(tmp_path / "config.yaml"), log=lines.append)
    assert result.last_step == 1
    (warning,) = [line for line in lines if line.startswith("warning")]
    assert f"data.path: '{world.data}' in the store, '{other}' in the config" in warning
    assert "data.max_length: 96 in the store, 64 in the config" in warning
    assert "the store, not the config, is what trains" in warning


def test_a_data_file_changed_since_precompute_warns(world: World, tmp_path: Path) -> None:
    """The same data.path with other bytes: the store's ingest record holds the file's size and hash."""
    data = Path(shutil.copy(world.math_data, tmp_path / "math.jsonl"))
    math_only = {"math": world.teachers["math"]}
    config_path = write_train_config(
        tmp_path,
        math_only,
        data=data,
        store=tmp_path / "store.zarr",
        student=world.student,
        steps=1,
        optim=NO_WARMUP,
    )
    run_precompute(load_config(config_path), show_progress=False, log=lambda *_: None)
    lines: list[str] = []
    run_training(load_config(config_path), output=tmp_path / "same", log=lines.append)
    assert not [line for line in lines if line.startswith("warning")]
    with data.open("a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")
    lines.clear()
    run_training(load_config(config_path), output=tmp_path / "changed", log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning")]
    assert f"data.path: {data} has changed since the store was built from it" in warning
