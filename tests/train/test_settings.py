"""Training settings that do not fit the store or the machine say so in one line (issue 30)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.train.trainer import run_training
from tests.precompute.teachers import write_jsonl
from tests.train.world import World, world_config, write_train_config


def test_a_batch_budget_smaller_than_a_row_warns_once_with_the_numbers(world: World, tmp_path: Path) -> None:
    longest = int(open_store(world.store).lengths.max())
    config = world_config(
        world, tmp_path, steps=1, batch={"micro_batch_tokens": longest - 1}, optim={"warmup_steps": 0}
    )
    lines: list[str] = []
    assert run_training(config, log=lines.append).last_step == 1
    (warning,) = [line for line in lines if line.startswith("warning")]
    assert (
        f"train.batch.micro_batch_tokens {longest - 1} < the store's longest row ({longest} tokens)"
        in warning
    )
    assert "global_batch_tokens" not in warning  # 1024 holds the longest row


def test_a_cuda_device_this_machine_lacks_is_one_line(world: World, tmp_path: Path) -> None:
    world_config(world, tmp_path, steps=1, device="cuda:99")
    out = CliRunner().invoke(cli, ["train", str(tmp_path / "config.yaml")])
    code, output = out.exit_code, out.output
    assert code == 1 and "train.device: 'cuda:99'" in output and "Traceback" not in output


def test_no_trained_token_in_a_store_or_a_step_is_refused(world: World, tmp_path: Path) -> None:
    """Rows whose loss masks are all 0: a dataset of only those is refused by precompute; a step made
    only of those is refused by train before the optimiser moves (each one line, exit 1)."""
    masked = {"agent": "math", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]}
    trained = {**masked, "loss_mask": [0, 1, 1, 1]}
    math_only = {"math": world.teachers["math"]}
    for name, rows in (("none", [masked] * 4), ("few", [trained] + [masked] * 7)):
        config = write_train_config(
            tmp_path / name,
            math_only,
            data=write_jsonl(tmp_path / f"{name}.jsonl", rows),
            store=tmp_path / name / "store.zarr",
            student=world.student,
            steps=8,
            batch={"micro_batch_tokens": 4, "global_batch_tokens": 4},  # one row a step
        )
        if name == "none":
            out = CliRunner().invoke(cli, ["precompute", str(config)])
            assert out.exit_code == 1 and "none of its 4 rows has a trained token" in out.output
            assert (
                "Traceback" not in out.output
                and not (tmp_path / name / "store.zarr" / "manifest.json").exists()
            )
            continue
        run_precompute(load_config(config), show_progress=False, log=lambda *_: None)
        out = CliRunner().invoke(cli, ["train", str(config)])
        assert out.exit_code == 1, out.output
        assert "none of its rows has a trained token" in out.output and "Traceback" not in out.output
