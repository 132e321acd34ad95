"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases and MLflow, fed the records of
metrics.jsonl.

Each record becomes slash-namespaced scalars (`train/loss`, `train/divergence/code`,
`eval/divergence/chat+math`: teachers by name; the step too, as `train/step`), logged at its step.
Rank 0 tracks; the config is logged once, when a tracker run starts. A resumed run appends to the same
tracker runs: their ids (and the TensorBoard folder) are kept in every checkpoint. TensorBoard purges
its events past the resumed step; a W&B chart plotted against `train/step` shows the steps trained
again after the resume beside the lost ones.

Where they write, by default: TensorBoard `OUTPUT/tensorboard/`; W&B `OUTPUT/wandb/` and its server, as
W&B's own settings say (`WANDB_MODE=offline`, `WANDB_PROJECT`, default project `mopd`); MLflow the
SQLite database `OUTPUT/mlflow.db` (or `MLFLOW_TRACKING_URI`; experiment `MLFLOW_EXPERIMENT_NAME`,
default `mopd`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mopd.base.errors import ConfigError
from mopd.train.report.metrics import Record, TeacherNames, by_name

TENSORBOARD_FOLDER = "tensorboard"
WANDB_FOLDER = "wandb"
MLFLOW_DATABASE = "mlflow.db"
PROJECT = "mopd"  # W&B project and MLflow experiment unless their own settings name one

# The packages each tracker needs (the `tracking` extra installs them all).
PACKAGES = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "mlflow": ["mlflow", "sqlalchemy", "alembic"]}


# A record's values by teacher (or teacher set), and the scalars' group of each.
BY_TEACHER = {
    "divergence_by_teacher": "divergence",
    "aligned_share_by_teacher": "aligned_share",
    "selection_share_by_teacher": "selection_share",
}


def scalars(record: Record | Mapping[str, Any], names: TeacherNames) -> dict[str, float]:
    """A metrics record as slash-namespaced scalars under its split (`train` unless it says otherwise);
    per-teacher values by teacher name."""
    split = record.get("split", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "split":
            continue
        if key in BY_TEACHER:
            out |= {f"{split}/{BY_TEACHER[key]}/{name}": v for name, v in by_name(value, names).items()}
        else:
            out[f"{split}/{key}"] = float(value)
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """A nested config as (dotted key, value as text) pairs: MLflow's parameters are flat."""
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...
    def identity(self) -> str: ...  # what a resumed run needs to append to the same tracker run
    def where(self) -> str: ...  # where its records go, and how to look at them (one line)
    def close(self) -> None: ...


class TensorBoard:
    """Event files under `folder`; a resume from `step` purges the events written after it."""

    def __init__(self, folder: Path, *, config: Mapping[str, Any], resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        if resume_step is None:
            text = json.dumps(config, indent=2, sort_keys=True)
            self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def identity(self) -> str:
        return str(self.folder)

    def where(self) -> str:
        return f"tensorboard: events in {self.folder} (view: tensorboard --logdir {self.folder})"

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in `folder`, new or (given its id) resumed; its mode, project and entity are W&B's
    own settings (`WANDB_MODE`, `WANDB_PROJECT`, `WANDB_ENTITY`)."""

    def __init__(self, folder: Path, *, name: str, config: Mapping[str, Any], run_id: str | None) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            dir=str(folder.parent),  # wandb writes into <dir>/wandb
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=dict(config) if run_id is None else None,
            reinit="create_new",
        )
        self._splits: set[str] = set()

    def log(self, values: dict[str, float], step: int) -> None:
        for key in values:
            split = key.split("/", 1)[0]
            if split not in self._splits:  # the split's charts plot against its own step
                self.run.define_metric(f"{split}/step")
                self.run.define_metric(f"{split}/*", step_metric=f"{split}/step")
                self._splits.add(split)
        self.run.log(values)

    def identity(self) -> str:
        return str(self.run.id)

    def where(self) -> str:
        mode = "offline, sync with `wandb sync`" if self.run.settings.mode == "offline" else self.run.url
        return f"wandb: run {self.run.id} in {self.run.dir} ({mode})"

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run, new or (given its id) resumed, in `MLFLOW_TRACKING_URI` or else the SQLite file
    `database` (MLflow's local store; its file store no longer starts without an opt-out)."""

    def __init__(self, database: Path, *, name: str, config: Mapping[str, Any], run_id: str | None) -> None:
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{database.resolve()}"
        self.client = MlflowClient(uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                experiment_name, artifact_location=(database.parent / "mlflow-artifacts").resolve().as_uri()
            )
        )
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self._log_params(dict(flatten(config)))

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:6000]) for key, value in sorted(params.items())]  # MLflow's value limit
        for start in range(0, len(items), 100):  # MLflow's batch limit on parameters
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def identity(self) -> str:
        return self.run_id

    def where(self) -> str:
        uri = self.client.tracking_uri
        return f"mlflow: run {self.run_id} in {uri} (view: mlflow ui --backend-store-uri {uri})"

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def check_trackers(report_to: Sequence[str]) -> None:
    """Refuses a tracker whose packages are not installed, naming the extra that brings them."""
    for tracker in report_to:
        missing = [p for p in PACKAGES[tracker] if importlib.util.find_spec(p) is None]
        if missing:
            raise ConfigError(
                f"train.report_to: {tracker} needs {', '.join(missing)}, which is not installed: "
                "pip install 'mopd[tracking]'"
            )


class Trackers:
    """The trackers of `report_to` writing under `folder` (an empty list tracks nothing).

    `resumed` holds the identities a checkpoint kept (`identities()`), to append to the same runs, and
    `resume_step` the step it was taken after.
    """

    def __init__(
        self,
        report_to: Sequence[str],
        folder: Path,
        *,
        name: str,
        config: Mapping[str, Any],
        names: TeacherNames,
        resumed: Mapping[str, str] | None = None,
        resume_step: int | None = None,
    ) -> None:
        check_trackers(report_to)
        self.names = names
        self.trackers: dict[str, Tracker] = {}
        resumed = resumed or {}
        try:
            for kind in report_to:
                previous = resumed.get(kind)
                if kind == "tensorboard":
                    step = resume_step if previous else None
                    tracker: Tracker = TensorBoard(
                        folder / TENSORBOARD_FOLDER, config=config, resume_step=step
                    )
                elif kind == "wandb":
                    tracker = WandB(folder / WANDB_FOLDER, name=name, config=config, run_id=previous)
                else:
                    tracker = MLflow(folder / MLFLOW_DATABASE, name=name, config=config, run_id=previous)
                self.trackers[kind] = tracker
        except BaseException:
            self.close()
            raise

    def log(self, record: Record | Mapping[str, Any]) -> None:
        """The record's scalars at its step, to every tracker."""
        values = scalars(record, self.names)
        for tracker in self.trackers.values():
            tracker.log(values, record["step"])

    def where(self) -> list[str]:
        """A line per tracker: where it writes."""
        return [tracker.where() for tracker in self.trackers.values()]

    def identities(self) -> dict[str, str]:
        return {kind: tracker.identity() for kind, tracker in self.trackers.items()}

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}
