"""Training checkpoints: everything `--resume` needs to continue exactly, with no pickle (DESIGN §7).

    OUTPUT/checkpoints/step_00000100/
        model/                  the student as a transformers checkpoint (config + safetensors)
        optimizer.safetensors   AdamW moments and step counts, keyed "<param position>.<name>"
        rng.safetensors         torch RNG states
        state.json              step, loader state, optimizer hyper-parameters, scheduler state
        teachers.json           the store's teacher list: index, checkpoint, fingerprint
        COMPLETE                written last; a folder without it is not a checkpoint

A checkpoint is written under a temporary name, fsynced, and published by a rename, so a crash leaves
either nothing or a complete checkpoint. Retention deletes only older complete checkpoints, never the
newest one.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mopd.store.errors import ConfigError, MopdError
from mopd.store.fsio import is_temporary, publish_dir, unique_temp_name, write_replace
from mopd.store.teachers import TeacherIdentity, write_teacher_list
from mopd.train.data_order import LoaderState
from mopd.train.student import HFStudent

COMPLETE = "COMPLETE"
_NAME = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class ResumePoint:
    step: int
    loader: LoaderState


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = optimizer.state_dict()
    tensors = {
        f"{position}.{name}": value.detach().contiguous().cpu()
        for position, slots in state["state"].items()
        for name, value in slots.items()
    }
    return tensors, state["param_groups"]


def save_checkpoint(
    root: Path,
    step: int,
    *,
    student: HFStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: LoaderState,
    teachers: Sequence[TeacherIdentity],
    keep: int,
) -> Path:
    """Writes and publishes the checkpoint of `step`, then drops complete ones older than the last `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    temp = unique_temp_name(final)
    temp.mkdir()
    try:
        student.save(temp / "model")
        tensors, groups = _optimizer_tensors(optimizer)
        save_file(tensors, str(temp / "optimizer.safetensors"))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        save_file(rng, str(temp / "rng.safetensors"))
        scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        state = {
            "step": step,
            "loader": loader.to_dict(),
            "param_groups": groups,
            "scheduler": scheduler_state,
        }
        write_replace(temp / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
        write_teacher_list(temp, teachers)
        write_replace(temp / COMPLETE, json.dumps({"step": step, "time": time.time()}).encode())
        if final.exists() and not (final / COMPLETE).exists():
            # A folder without its marker is not a checkpoint; move it aside (a temporary: garbage).
            final.rename(unique_temp_name(final))
        if not publish_dir(temp, final):
            raise MopdError(f"checkpoint {final} already exists; another run writes into this output folder")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.iterdir():
        if is_temporary(stale.name) and stale.name.startswith(checkpoint_name(step)):
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(
    folder: Path,
    *,
    student: HFStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> ResumePoint:
    """Restores model, optimizer, scheduler and RNG from `folder`; returns the step and loader state."""
    if not (folder / COMPLETE).exists():
        raise ConfigError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        state: dict[str, Any] = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder}/state.json is unreadable: {err}") from err
    student.load_weights(folder / "model")
    tensors = load_file(str(folder / "optimizer.safetensors"))
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        position, name = key.split(".", 1)
        slots.setdefault(int(position), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in state["param_groups"]]
    optimizer.load_state_dict({"state": slots, "param_groups": groups})
    scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return ResumePoint(step=int(state["step"]), loader=LoaderState.from_dict(state["loader"]))
