"""A checkpoint knows what it was trained on: resuming with another store or any recorded setting is
refused naming the field, its old and its new value; `train.init_from` starts a new run from a
checkpoint instead; a damaged checkpoint file is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mopd.base.errors import CheckpointError
from mopd.cli.main import cli
from mopd.config.mopd_config import EFFECTIVE_CONFIG_FILE, load_config
from mopd.store import open_store
from mopd.store.format.loading import load_plan
from mopd.train.checkpoint.run_record import RESUMABLE, diff_run_records, run_record
from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.schedule import lr_factor
from mopd.train.trainer import Trainer, run_training
from tests.train.world import World, world_config

BASE = dict(steps=4, checkpoint={"every": 1, "keep": 4}, eval={"rows": 4, "every": 0})


def train(config: Any, **kwargs: Any) -> Any:
    return run_training(config, log=lambda _line: None, **kwargs)


@pytest.fixture
def two_steps(world: World, tmp_path: Path) -> Path:
    """A run folder holding checkpoints of steps 1 and 2."""
    train(world_config(world, tmp_path / "base", **BASE), max_steps=2)
    return tmp_path / "base" / "run"


@pytest.mark.parametrize(
    ("change", "field", "old", "new"),
    [
        ({"store": "math_rows_store"}, "store.manifest_hash", None, None),
        ({"batch": {"global_batch_tokens": 2048}}, "train.batch.global_batch_tokens", "1024", "2048"),
        ({"batch": {"micro_batch_tokens": 256}}, "train.batch.micro_batch_tokens", "512", "256"),
        ({"seed": 3}, "train.seed", "0", "3"),
        ({"divergence": {"kind": "forward_kl"}}, "train.divergence.kind", "'reverse_kl'", "'forward_kl'"),
        ({"divergence": {"temperature": 2.0}}, "train.divergence.temperature", "1.0", "2.0"),
        ({"teacher_weights": {"code": 2.0}}, "train.teacher_weights", "{}", "{'code': 2.0}"),
        ({"eval": {"rows": 8, "every": 0}}, "train.eval.rows", "4", "8"),
        ({"optim": {"lr": 1.0e-3, "warmup_steps": 2}}, "train.optim.lr", "0.005", "0.001"),
    ],
)
def test_resume_refuses_a_changed_store_or_setting(
    world: World, tmp_path: Path, two_steps: Path, change: dict, field: str, old: str | None, new: str | None
) -> None:
    options: dict[str, Any] = {**BASE, **{k: v for k, v in change.items() if k != "store"}}
    store = getattr(world, change["store"]) if "store" in change else None
    config = world_config(world, tmp_path / "changed", store=store, **options)
    with pytest.raises(CheckpointError) as err:
        train(config, output=two_steps)
    message = str(err.value)
    assert "cannot resume from" in message and "train.init_from" in message
    (line,) = [line.strip() for line in message.splitlines() if line.strip().startswith(field + ":")]
    if old is not None:
        assert line == f"{field}: {old} in the checkpoint, {new} now"
    assert [p.name for p in complete_checkpoints(two_steps / "checkpoints")][-1] == "step_00000002"


def test_resume_allows_the_documented_settings(world: World, tmp_path: Path, two_steps: Path) -> None:
    config = world_config(
        world,
        tmp_path / "more",
        **{**BASE, "steps": 5, "checkpoint": {"every": 2, "keep": 1}, "lm_head_lifecycle": "evict"},
    )
    result = train(config, output=two_steps)
    assert (result.first_step, result.last_step) == (3, 5)


def test_a_resume_with_more_steps_follows_the_new_schedule(world: World, tmp_path: Path) -> None:
    """A run of 2 steps resumed with `train.steps: 4` trains step 3 at the 4-step schedule's rate, not at
    the end of the 2-step schedule (which is 0)."""
    optim = {"lr": 5.0e-3, "warmup_steps": 1}
    train(world_config(world, tmp_path / "short", **{**BASE, "steps": 2, "optim": optim}))
    longer = world_config(world, tmp_path / "long", **{**BASE, "steps": 4, "optim": optim})
    result = train(longer, output=tmp_path / "short" / "run")
    rates = {r["step"]: r["lr"] for r in result.records if "lr" in r}
    assert sorted(rates) == [3, 4]
    for step, rate in rates.items():  # the schedule's `step` counts from 0
        assert rate == pytest.approx(5.0e-3 * lr_factor(step - 1, warmup=1, total=4), rel=1e-12)
    assert rates[3] > rates[4] > 0


def test_the_record_covers_every_setting_but_the_resumable_ones(world: World, tmp_path: Path) -> None:
    config = world_config(world, tmp_path, **BASE)
    assert config.train is not None
    record = run_record(config.train, open_store(world.store).manifest)
    assert {"train.seed", "train.dtype", "train.backend", "train.mixed_precision"} <= set(record)
    assert not any(name.startswith(tuple(RESUMABLE)) for name in record)
    assert diff_run_records(record, {**record, "train.mixed_precision": "bf16"}) == [
        "train.mixed_precision: 'none' in the checkpoint, 'bf16' now"
    ]
    # The rank count is not part of a run (a run resumes on any other); the store's encoding is.
    assert "data_parallel_size" not in record
    assert record["store.encoding"] == "exact"
    assert diff_run_records(record, {**record, "store.encoding": "int8-rotated"}) == [
        "store.encoding: 'exact' in the checkpoint, 'int8-rotated' now"
    ]


def test_init_from_starts_a_new_run_from_a_checkpoints_weights(
    world: World, tmp_path: Path, two_steps: Path
) -> None:
    """On another store (other rows), from step 1: its first step equals a run whose student is the
    checkpoint's exported model; with optimizer: true the AdamW moments come along."""
    checkpoint = two_steps / "checkpoints" / "step_00000002"
    started = train(
        world_config(
            world, tmp_path / "init", store=world.math_rows_store, init_from=str(checkpoint), **BASE
        ),
        max_steps=1,
    )
    assert started.first_step == 1
    exported = train(
        world_config(
            world, tmp_path / "exported", store=world.math_rows_store, student=checkpoint / "model", **BASE
        ),
        max_steps=1,
    )
    assert started.records[0]["divergence"] == exported.records[0]["divergence"]  # eval at step 0
    trainer = Trainer(
        world_config(
            world,
            tmp_path / "with-optimizer",
            init_from={"checkpoint": str(two_steps), "optimizer": True},  # a run folder: its newest
            **BASE,
        ),
        log=lambda _line: None,
    )
    trainer.start_from()
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments[:3])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5.0e-3 * 0.5)  # this run's schedule
    trainer.student.close()


def test_a_damaged_checkpoint_file_is_named(world: World, tmp_path: Path, two_steps: Path) -> None:
    latest = two_steps / "checkpoints" / "step_00000002" / "optimizer.safetensors"
    data = bytearray(latest.read_bytes())
    data[-5] ^= 0x01
    latest.write_bytes(bytes(data))
    config = tmp_path / "base" / "config.yaml"
    result = CliRunner().invoke(cli, ["train", str(config), "--output", str(two_steps)])
    assert result.exit_code == 1
    assert f"{latest}: content changed" in result.stderr and "Traceback" not in result.stderr
    verify = CliRunner().invoke(
        cli, ["verify-manifest", str(world.store), "--checkpoint", str(latest.parent)]
    )
    assert verify.exit_code == 1 and f"{latest}: content changed" in verify.stdout


def test_overrides_are_what_the_run_records(world: World, tmp_path: Path, two_steps: Path) -> None:
    """`mopd train CONFIG key=value`: the run folder's config.yaml holds the effective config (it loads
    back equal to what ran), and the resume guard sees an overridden setting as the change it is."""
    config = tmp_path / "base" / "config.yaml"
    steps = CliRunner().invoke(cli, ["train", str(config), "train.steps=5", "--output", str(two_steps)])
    assert steps.exit_code == 0, steps.output  # train.steps may change on resume: steps 3 to 5 train
    effective = load_config(two_steps / EFFECTIVE_CONFIG_FILE)
    assert effective == load_config(config, ["train.steps=5"])
    assert effective.train is not None and effective.train.steps == 5
    assert [r["step"] for r in read_metrics(two_steps / METRICS_FILE) if "split" not in r][-1] == 5
    seed = CliRunner().invoke(cli, ["train", str(config), "train.seed=3", "--output", str(two_steps)])
    assert seed.exit_code == 1 and "train.seed: 0 in the checkpoint, 3 now" in seed.stderr


def test_precompute_records_its_overrides_in_the_plan(world: World, tmp_path: Path) -> None:
    """`mopd precompute CONFIG key=value`: the plan holds the creating job's effective config, outside
    the identity, so a job with other run-time settings joins the same store."""
    world_config(world, tmp_path)  # writes tmp_path / config.yaml
    store = tmp_path / "overridden.zarr"
    first = [
        "precompute",
        str(tmp_path / "config.yaml"),
        f"store.path={store}",
        "precompute.batch_tokens=512",
    ]
    assert (
        ran := CliRunner().invoke(cli, [*first, "--num-tasks", "2", "--task-index", "0"])
    ).exit_code == 0, ran.output
    plan = load_plan(store)
    assert plan.created_with["precompute"]["batch_tokens"] == 512
    assert plan.created_with["store"]["path"] == str(store)
    assert (
        load_config(
            tmp_path / "config.yaml", [f"store.path={store}", "precompute.batch_tokens=512"]
        ).model_dump(mode="json", exclude_defaults=True)
        == plan.created_with
    )
    second = [*first[:-1], "precompute.batch_tokens=256", "--num-tasks", "2", "--task-index", "1"]
    assert (joined := CliRunner().invoke(cli, second)).exit_code == 0, joined.output
    assert open_store(store).num_rows == 64 and load_plan(store) == plan  # written once
