"""A user's first hour: each mistake a newcomer makes gets one line that names the key or file (with the
path it resolved to) and says the fix, before anything heavy loads; what mopd writes others can read;
a run says what it trains with, where its outputs go, and every checkpoint it saves."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.config.paths import missing_paths, rounds_paths
from mopd.store.format.loading import read_manifest
from mopd.train.checkpoint.export import export_hf
from mopd.train.trainer import run_training
from tests.train.world import World, world_config


def mopd(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_a_mistyped_teacher_path_is_a_missing_checkpoint_everywhere(world: World, tmp_path: Path) -> None:
    """`teachers.code` pointing nowhere: train refuses in one line before the student loads (never "a
    different teacher" with advice to precompute again), precompute says the same, and verify-manifest
    --config names the checkpoint that does not exist beside the store's."""
    typo = tmp_path / "code-teacher-typo"
    world_config(world, tmp_path, teachers={**world.teachers, "code": typo})
    config = tmp_path / "config.yaml"
    expected = (
        f"error: {config} names a path that does not exist — teachers.code: {typo} (paths in the file are "
        f"relative to its folder, {tmp_path}; mopd reads local checkpoints only): correct the config or "
        "create them"
    )
    for command in (["train"], ["precompute"], ["rounds"]):
        result = mopd(*command, str(config))
        assert result.exit_code == 1
        assert error_lines(result) == [expected], command
    verify = mopd("verify-manifest", str(world.store), "--config", str(config))
    assert verify.exit_code == 1
    stored = next(t for t in read_manifest(world.store).teachers if "code" in t.aliases)
    assert verify.stdout.splitlines() == [
        f"teachers.code: checkpoint {typo} does not exist (the store's teacher {stored.index} is "
        f"{stored.checkpoint}); correct the path"
    ]


def test_a_copied_config_lists_every_missing_path_at_once(world: World, tmp_path: Path) -> None:
    """A config with relative paths copied to another folder: the store, every teacher and the student
    are named in one line, each with the path it resolved to, before anything loads."""
    home = tmp_path / "home"
    for name, source in (("math", world.teachers["math"]), ("code", world.teachers["code"])):
        shutil.copytree(source, home / name)
    shutil.copytree(world.student, home / "student")
    shutil.copytree(world.store, home / "store.zarr")
    raw = yaml.safe_load(world_config(world, home).model_dump_json())
    raw = {key: raw[key] for key in ("teachers", "routing", "data", "store")} | {
        "train": {"student": "student", "steps": 1, "output_dir": "run"}
    }
    raw["teachers"] = {"math": "math", "code": "code"}
    raw["store"] = {"path": "store.zarr"}
    raw["data"] = {"path": str(world.data), "max_length": raw["data"]["max_length"]}
    (home / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(home / "config.yaml", moved / "config.yaml")
    result = mopd("train", str(moved / "config.yaml"))
    assert result.exit_code == 1
    missing = {"store.path": "store.zarr", "teachers.math": "math", "teachers.code": "code"}
    listed = "; ".join(
        f"{key}: {moved / name}" for key, name in {**missing, "train.student": "student"}.items()
    )
    assert error_lines(result) == [
        f"error: {moved / 'config.yaml'} names 4 paths that do not exist — {listed} (paths in the file are "
        f"relative to its folder, {moved}; mopd reads local checkpoints only): correct the config or create "
        "them"
    ]
    assert "loading student" not in result.stderr


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "train.step=5",
            "error: command line train.step=5: train has no key step; did you mean train.steps?",
        ),
        (
            "train.steps=5k",
            "error: command line train.steps=5k: `train.steps`: '5k' is text, not a number (write a number, "
            "e.g. 5000 or 3e-4)",
        ),
        (
            "trian.steps=5",
            "error: command line trian.steps=5: the config has no key trian; did you mean train?",
        ),
        (
            "train.optim.learning_rate=1e-4",
            "error: command line train.optim.learning_rate=1e-4: train.optim has no key learning_rate (its "
            "keys: lr, weight_decay, warmup_steps, grad_clip; all are in docs/config.md)",
        ),
    ],
)
def test_a_mistyped_override_is_blamed_on_the_command_line(
    world: World, tmp_path: Path, override: str, line: str
) -> None:
    world_config(world, tmp_path)
    result = mopd("train", str(tmp_path / "config.yaml"), override)
    assert result.exit_code == 1
    assert error_lines(result) == [line]


def test_a_mistyped_key_in_the_file_is_blamed_on_the_file(world: World, tmp_path: Path) -> None:
    world_config(world, tmp_path)
    path = tmp_path / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["train"]["optim"]["warmup_step"] = 3
    raw["train"]["steps"] = "50"
    path.write_text(yaml.safe_dump(raw))
    result = mopd("train", str(path))
    assert error_lines(result) == [
        f"error: {path}: train.optim has no key warmup_step; did you mean train.optim.warmup_steps?; {path}: "
        "`train.steps`: '50' is text, not a number (write it without quotes)"
    ]


def test_one_tracker_is_taken_where_a_list_is_expected(world: World, tmp_path: Path) -> None:
    world_config(world, tmp_path)
    config = load_config(tmp_path / "config.yaml", ["train.report_to=tensorboard"])
    assert config.train is not None and config.train.report_to == ["tensorboard"]


@pytest.mark.parametrize("command", ["train", "precompute", "rollout", "rounds"])
def test_every_command_with_a_config_explains_key_value_in_its_help(command: str) -> None:
    text = " ".join(mopd(command, "--help").stdout.split())
    assert "KEY=VALUE after CONFIG sets a key of the config for this command" in text
    assert "train.report_to=tensorboard" in text and "docs/config.md" in text
    if command == "train":
        assert "fsdp (the student and its AdamW state sharded over the ranks" in text


@pytest.fixture
def umask() -> Iterator[None]:
    """The umask a shared machine's users have (022), restored after."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("umask")
def test_what_a_run_writes_follows_the_umask(world: World, tmp_path: Path) -> None:
    """Checkpoints and the exported student are readable by others under umask 022 (0644, as every
    other file), not left 0600 by the library that wrote the weights."""
    result = run_training(world_config(world, tmp_path, steps=1), log=lambda _line: None)
    assert result.checkpoint is not None
    exported = tmp_path / "exported"
    export_hf(result.checkpoint, exported)
    files = [p for root in (result.checkpoint, exported) for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and any(
        p.suffix == ".safetensors" for p in files
    )
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


def test_a_run_says_what_it_trains_with_and_where_it_writes(world: World, tmp_path: Path) -> None:
    """The start lines state the backend, the processes, the precision as it takes effect, activation
    checkpointing and where the trackers write; a warmup as long as the run is warned of; every
    checkpoint save is a line of its own."""
    world_config(
        world,
        tmp_path,
        steps=2,
        mixed_precision="bf16",
        activation_checkpointing=True,
        report_to="tensorboard",
        checkpoint={"every": 1, "keep": 2},
    )
    result = mopd("train", str(tmp_path / "config.yaml"))
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    run = tmp_path / "run"
    assert (
        f"loading student {world.student} on cpu: backend hf, 1 process, bf16 autocast over fp32 weights, "
        "activation checkpointing on"
    ) in lines
    events = run / "tensorboard"
    assert f"tensorboard: events in {events} (view: tensorboard --logdir {events})" in lines
    assert (
        "warning: train.optim.warmup_steps 2 ≥ train.steps 2: the learning rate rises for the whole run and "
        "reaches train.optim.lr 0.005 only at the last step; set warmup_steps below steps (e.g. "
        "train.optim.warmup_steps=1)"
    ) in lines
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {run / 'checkpoints' / f'step_0000000{step}'} (a resume starts after step {step})"
        for step in (1, 2)
    ]
    assert lines[-1] == f"trained steps 1..2; checkpoint {run / 'checkpoints' / 'step_00000002'}"


def test_a_store_path_that_is_not_a_store_names_the_key_and_the_store_below(
    world: World, tmp_path: Path
) -> None:
    (tmp_path / "stores").mkdir()
    shutil.copytree(world.store, tmp_path / "stores" / "teachers.zarr")
    world_config(world, tmp_path, store=tmp_path / "stores")
    result = mopd("train", str(tmp_path / "config.yaml"))
    assert error_lines(result) == [
        f"error: store.path: {tmp_path / 'stores'} is not a mopd store: it has no manifest.json and no "
        f"_plan.json; the store one folder down is {tmp_path / 'stores' / 'teachers.zarr'}"
    ]


def test_inspect_fits_80_columns(world: World) -> None:
    """In a pipe (80 columns) the table and each value's line fit: no alias, size or fingerprint is cut
    in two; only a path longer than the width folds."""
    result = mopd("inspect", str(world.store))
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    header = next(line for line in lines if "aliases" in line).split()
    assert header == ["#", "aliases", "rows", "tokens", "on", "disk", "B/token", "as", "fp32", "logits"]
    table = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert sorted(row[1] for row in table) == ["code", "math"], lines
    notes = [line for line in lines if "fingerprint" in line]
    assert [line.split()[0] for line in notes] == ["fingerprint", "fingerprint"]


def test_rounds_check_the_fixed_dataset_only_where_they_mix_it_in(world: World, tmp_path: Path) -> None:
    """`mopd rounds` reads data.path only for rounds.off_policy_fraction > 0: a purely on-policy config
    whose data.path is gone is not refused for it."""
    world_config(world, tmp_path)
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    raw["data"]["path"] = str(tmp_path / "gone.jsonl")
    raw["rollout"] = {"prompts": str(world.data)}
    for fraction, missing in ((0.0, []), (0.5, [("data.path", str(tmp_path / "gone.jsonl"))])):
        raw["rounds"] = {"count": 1, "steps_per_round": 1, "off_policy_fraction": fraction}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
        config = load_config(tmp_path / "config.yaml")
        assert missing_paths(config, rounds_paths(config)) == missing
