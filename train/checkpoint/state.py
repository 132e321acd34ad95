"""Training checkpoints: everything `--resume` needs to continue exactly, with no pickle (DESIGN §7),
written under a temporary name and published by a rename (the files: docs/internals.md).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from safetensors.torch import load_file, save_file

from mopd.base import faults
from mopd.base.completion import COMPLETE, write_complete
from mopd.base.errors import CheckpointError, MopdError
from mopd.base.fsio import is_temporary, publish_dir, unique_temp_name, write_replace
from mopd.base.jsonio import read_json, validated
from mopd.store.format.teachers import TeacherIdentity, write_teacher_list
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.protocol import MODEL_DIR, StudentLayout, TrainStudent, parameter_groups
from mopd.train.checkpoint.run_record import RunRecord
from mopd.train.data.order import LoaderState

_NAME = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class ResumePoint:
    step: int
    loader: LoaderState
    tracking: dict[str, str]  # the tracker runs the run appended to (`tracking.Trackers.identities`)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(path: Path) -> Path | None:
    """The checkpoint `path` stands for: itself when it is a complete checkpoint, else the newest complete
    one of a run folder (under its `checkpoints/`) or of a checkpoints folder; None when there is none."""
    if (path / COMPLETE).exists():
        return path
    found = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
    return found[-1] if found else None


def save_checkpoint(
    root: Path,
    step: int,
    *,
    student: TrainStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: LoaderState,
    teachers: Sequence[TeacherIdentity],
    run: RunRecord,
    keep: int,
    world: RankGroup | None = None,
    tracking: dict[str, str] | None = None,
) -> Path:
    """Writes and publishes the checkpoint of `step`, then drops complete ones older than the last `keep`.

    Every rank of `world` calls it: the student's backend writes its weights and AdamW state into the
    temporary folder rank 0 made (`TrainStudent.save_state`: one replica the whole, or every rank its
    shards), and rank 0 writes the rest and publishes once they all have. `run` is
    the run record (`run_record.run_record`) a resume must match; `tracking` the tracker runs a resume
    appends to.
    """
    world = world or RankGroup()
    final = root / checkpoint_name(step)
    temp = _stage(root, final, world)
    try:
        student.save_state(temp, optimizer)
        world.barrier()
        if world.rank == 0:
            _write_run_state(
                temp, step, student.layout, optimizer, scheduler, loader, teachers, run, tracking or {}
            )
            faults.point("checkpoint-written")
            _publish(temp, final)
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if world.rank == 0:
        _retain(root, step, keep)
        faults.point("checkpoint-retained")
    world.barrier()
    return final


def _stage(root: Path, final: Path, world: RankGroup) -> Path:
    """The temporary folder the checkpoint is written into, made by rank 0, named to every rank."""
    made = None
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        made = unique_temp_name(final)
        (made / MODEL_DIR).mkdir(parents=True)
    return Path(world.broadcast_object(str(made)))


def _publish(temp: Path, final: Path) -> None:
    """Renames the written checkpoint onto its name (a folder there without its marker is not a
    checkpoint: moved aside as a temporary, which is garbage)."""
    if final.exists() and not (final / COMPLETE).exists():
        final.rename(unique_temp_name(final))
    if not publish_dir(temp, final, what="checkpoint"):
        raise MopdError(f"checkpoint {final} already exists; another run writes into this output folder")


def _write_run_state(
    folder: Path,
    step: int,
    layout: StudentLayout,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: LoaderState,
    teachers: Sequence[TeacherIdentity],
    run: RunRecord,
    tracking: dict[str, str],
) -> None:
    """The files every rank shares: RNG, state.json, the teacher list, then the COMPLETE marker."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    with faults.io("write", folder / "rng.safetensors"):
        save_file(rng, str(folder / "rng.safetensors"))
    state = {
        "step": step,
        "loader": loader.to_dict(),
        "param_groups": parameter_groups(optimizer),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "layout": layout.model_dump(exclude_none=True),
        "run": run,
        "tracking": tracking,
    }
    write_replace(folder / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
    write_teacher_list(folder, teachers)
    write_complete(folder, {"step": step, "time": time.time()})


def _retain(root: Path, step: int, keep: int) -> None:
    """Drops complete checkpoints older than the last `keep`, and this step's leftover temporaries."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.iterdir():
        if is_temporary(stale.name) and stale.name.startswith(checkpoint_name(step)):
            shutil.rmtree(stale, ignore_errors=True)


def remove_temporaries(root: Path) -> list[str]:
    """Removes what killed saves left under `root` (folders never published); returns their names.

    Only the run that owns the output folder calls it, before it writes anything.
    """
    if not root.is_dir():
        return []
    stale = sorted(p.name for p in root.iterdir() if is_temporary(p.name))
    for name in stale:
        shutil.rmtree(root / name, ignore_errors=True)
    return stale


Count = Annotated[StrictInt, Field(ge=0)]


class LoaderRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: StrictInt
    epoch: Count
    step_in_epoch: Count


class SchedulerRecord(BaseModel):
    """The learning-rate schedule's state, as torch's LambdaLR keeps it: the rates it scales and the
    step it stands at (typed: mopd reads them), and torch's private counters (passed back as they are;
    the lambdas are the run's own)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    base_lrs: list[float]
    last_epoch: StrictInt

    @model_validator(mode="after")
    def _only_torch_counters(self) -> SchedulerRecord:
        unknown = sorted(k for k in self.model_extra or {} if not k.startswith("_"))
        if unknown:
            raise ValueError(f"not a field of the schedule's state: {', '.join(unknown)}")
        return self


class CheckpointState(BaseModel):
    """A checkpoint's state.json, read once (`read_state`): where the run stands, what it was trained on
    and by which layout (the optimizer's own fields are torch's to check)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: Count
    loader: LoaderRecord
    param_groups: list[dict[str, Any]]
    scheduler: SchedulerRecord
    layout: StudentLayout = StudentLayout()
    run: RunRecord = {}  # the run record (`run_record.run_record`)
    tracking: dict[str, str] = {}  # tracker → the identity of its run (`tracking.Trackers`)

    @property
    def loader_state(self) -> LoaderState:
        return LoaderState.from_dict(self.loader.model_dump())


def read_state(folder: Path) -> CheckpointState:
    """A complete checkpoint's state.json.

    Raises:
        CheckpointError: no COMPLETE marker, or state.json unreadable or malformed.
    """
    if not (folder / COMPLETE).exists():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    path = folder / "state.json"
    try:
        raw = read_json(path, what="checkpoint state", error=CheckpointError)
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing") from err
    layout = raw.get("layout") if isinstance(raw, dict) else None
    if isinstance(layout, dict) and "tp" in layout:
        raise CheckpointError(
            f"{folder} is a megatron checkpoint of one weights file per tensor-parallel slice and pipeline "
            "stage (layout tp × pp), a format of mopd before 0.1.0 that this version does not read; train "
            "that student again to get a checkpoint of this version"
        )
    return validated(CheckpointState, raw, what=f"{path}: malformed checkpoint state", error=CheckpointError)


def load_checkpoint(
    folder: Path,
    state: CheckpointState,
    *,
    student: TrainStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> ResumePoint:
    """Restores model, optimizer, scheduler and RNG from `folder`, whose `state` the caller read and
    checked (`resume.resume_checkpoint`); returns the step and loader state."""
    load_weights(folder, state, student, optimizer, hyper_parameters=True)
    lambdas = [None] * len(optimizer.param_groups)
    scheduler.load_state_dict({**state.scheduler.model_dump(), "lr_lambdas": lambdas})
    follow_schedule(scheduler, state.step)
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return ResumePoint(step=state.step, loader=state.loader_state, tracking=dict(state.tracking))


def follow_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Sets the learning rate of the step after `step` from the run's own schedule: a resume may have
    changed `train.steps`, and the rate the checkpoint's schedule left in the optimizer (its end, 0,
    when the checkpoint was that schedule's last step) is not the new schedule's."""
    scheduler.last_epoch = step - 1
    scheduler.step()  # recomputes every group's rate at `step` (counted from 0, as the trainer steps it)


def load_weights(
    folder: Path,
    state: CheckpointState,
    student: TrainStudent,
    optimizer: torch.optim.Optimizer | None,
    *,
    hyper_parameters: bool,
) -> None:
    """The student's weights and, given an optimizer, its AdamW moments and step counts; with
    `hyper_parameters` also the checkpoint's learning rate and the rest (a resume), else the optimizer
    keeps its own (a new run started from the checkpoint)."""
    own = parameter_groups(optimizer) if optimizer is not None else []
    student.load_state(folder, optimizer)
    if optimizer is None:
        return
    # Hyper-parameters from the run (a resume) or this run's own (a new run from the checkpoint).
    for group, saved in zip(
        optimizer.param_groups, state.param_groups if hyper_parameters else own, strict=True
    ):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
