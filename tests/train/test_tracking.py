"""`train.report_to`: TensorBoard, W&B (offline) and MLflow receive the records of metrics.jsonl, read
back with each library's own reader; a resumed run appends to the same tracker runs (issue 32)."""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mopd.base.errors import ConfigError
from mopd.train.checkpoint.state import complete_checkpoints, read_state
from mopd.train.report.metrics import METRICS_FILE, read_metrics, read_teacher_names
from mopd.train.report.tracking import (
    MLFLOW_DATABASE,
    TENSORBOARD_FOLDER,
    WANDB_FOLDER,
    check_trackers,
    scalars,
)
from mopd.train.trainer import Trainer, run_training
from tests.tolerance import U, assert_close
from tests.train.world import World, world_config


def wandb_history(run_file: Path) -> Iterator[dict[str, Any]]:
    """The history rows of a W&B run file (`run-<id>.wandb`): a 7-byte `:W&B` header, then LevelDB's log
    format (32 KiB blocks of records with a 7-byte header: checksum, length, type; a record split over
    blocks as FIRST, MIDDLE..., LAST) holding W&B's protobuf `Record`s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = struct.unpack_from("<HB", data, position + 4)
        if left < 7 or kind == 0:  # a block's zero-filled tail
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                # W&B stores a key holding `/` as its parts (`nested_key`)
                items = record.history.item
                yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def crash_during(step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Trainer.train_step

    def crashing(self: Trainer, at: int, batch: Any) -> Any:
        if at == step:
            raise KeyboardInterrupt("killed")
        return original(self, at, batch)

    monkeypatch.setattr(Trainer, "train_step", crashing)


@pytest.fixture
def wandb_service() -> Iterator[None]:
    """W&B's runs are served by a process of its own (`wandb-core`) that lives until the process that
    started it ends; the test session lives on, so the service is stopped after the test."""
    yield
    import wandb

    wandb.teardown()


def test_trackers_hold_what_metrics_jsonl_holds_and_a_resume_appends(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wandb_service: None
) -> None:
    """Killed during step 4 (checkpoints every 2), then resumed: each tracker holds steps 1..4 with the
    losses of metrics.jsonl, in one tracker run (W&B's id and MLflow's kept in the checkpoint), and
    TensorBoard's folder holds no step twice (the lost step 3 is purged)."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = world_config(
        world,
        tmp_path,
        steps=4,
        eval={"rows": 4, "every": 2},
        checkpoint={"every": 2, "keep": 1},
        report_to=["tensorboard", "wandb", "mlflow"],
    )
    with monkeypatch.context() as patch:
        crash_during(4, patch)
        with pytest.raises(KeyboardInterrupt):
            run_training(config, log=lambda _line: None)
    run_training(config, log=lambda _line: None)

    run = tmp_path / "run"
    records = read_metrics(run / METRICS_FILE)
    names = read_teacher_names(run / METRICS_FILE)
    losses = {r["step"]: r["loss"] for r in records if "split" not in r}
    evals = [r for r in records if r.get("split") == "eval"]
    assert sorted(losses) == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    name = names[next(iter(evals[-1]["divergence_by_teacher"]))]
    assert name in ("math", "code")

    board = EventAccumulator(str(run / TENSORBOARD_FOLDER))
    board.Reload()
    shown = board.Scalars("train/loss")
    assert [e.step for e in shown] == [1, 2, 3, 4]
    # TensorBoard stores a scalar as float32: one rounding of the float64 value.
    assert_close([e.value for e in shown], list(losses.values()), rtol=U, what="TB loss")
    assert [e.step for e in board.Scalars(f"eval/divergence/{name}")] == [0, 2, 4]
    assert board.Tags()["tensors"] == ["config/text_summary"]  # the config, as text, once

    files = sorted((run / WANDB_FOLDER).glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # one run id, resumed
    history = [row for file in files for row in wandb_history(file)]
    logged = {row["train/step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert logged == losses  # float64 kept; the resumed step 3 is the lost one's value exactly
    by_name = {row["eval/step"]: row[f"eval/divergence/{name}"] for row in history if "eval/step" in row}
    assert list(by_name) == [0, 2, 4]

    client = MlflowClient(f"sqlite:///{run / MLFLOW_DATABASE}")
    experiment = client.get_experiment_by_name("mopd")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    kept = read_state(complete_checkpoints(run / "checkpoints")[-1]).tracking
    assert kept == {
        "tensorboard": str(run / TENSORBOARD_FOLDER),
        "wandb": files[0].name.removeprefix("run-").removesuffix(".wandb"),
        "mlflow": found.info.run_id,
    }
    metric = client.get_metric_history(found.info.run_id, "train/loss")
    # MLflow keeps every value logged: the lost step 3, and its retrained value (the same number).
    assert sorted(m.step for m in metric) == [1, 2, 3, 3, 4]
    assert {m.step: m.value for m in metric} == losses
    assert found.data.params["train.steps"] == "4" and json.loads(found.data.params["train.report_to"]) == [
        "tensorboard",
        "wandb",
        "mlflow",
    ]


def test_records_become_slash_keys_with_teachers_by_name() -> None:
    record = {
        "split": "eval",
        "step": 3,
        "divergence": 0.5,
        "divergence_by_teacher": {"1": 0.25, "0": 0.75},
        "trained_tokens": 12,
    }
    assert scalars(record, {"0": "chat+math", "1": "code"}) == {
        "eval/step": 3.0,
        "eval/divergence": 0.5,
        "eval/divergence/chat+math": 0.75,
        "eval/divergence/code": 0.25,
        "eval/trained_tokens": 12.0,
    }
    assert set(scalars({"step": 1, "loss": 2.0, "ce": 1.5}, {})) == {"train/step", "train/loss", "train/ce"}


def test_a_missing_tracker_package_names_the_extra(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    check_trackers(["tensorboard", "mlflow"])
    with pytest.raises(
        ConfigError, match=r"^train.report_to: wandb needs wandb, .*pip install 'mopd\[tracking\]'"
    ):
        Trainer(world_config(world, tmp_path, report_to=["wandb"]), log=lambda _line: None)
