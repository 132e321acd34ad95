"""Training checkpoints: everything `--resume` needs to continue exactly, with no pickle (DESIGN §7).

    OUTPUT/checkpoints/step_00000100/
        model/                  the student as a transformers checkpoint (config + safetensors)
        optimizer.safetensors   AdamW moments and step counts, keyed "<param position>.<name>"
        rng.safetensors         torch RNG states
        state.json              step, loader state, optimizer hyper-parameters, scheduler state, layout
        teachers.json           the store's teacher list: index, checkpoint, fingerprint
        COMPLETE                written last; a folder without it is not a checkpoint

A megatron student writes one shard per tensor-parallel slice and pipeline stage instead:
`model/tpXX-ppYY.safetensors` (its Megatron parameter names; the first shard adds the student's config
and tokenizer files) and `optimizer-tpXX-ppYY.safetensors`; `mopd export-hf` joins the shards into a
transformers checkpoint. The layout (backend, tp, pp) is in state.json, and a run resumes only a
checkpoint of its own layout.

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
from mopd.train.distributed import DataParallel
from mopd.train.student import TrainStudent

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


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{position}.{name}": value.detach().contiguous().cpu()
        for position, slots in optimizer.state_dict()["state"].items()
        for name, value in slots.items()
    }


def optimizer_file(shard: str) -> str:
    return f"optimizer-{shard}.safetensors" if shard else "optimizer.safetensors"


def describe_layout(layout: dict[str, Any]) -> str:
    if layout.get("backend") == "megatron":
        return f"megatron tp={layout['tp']} × pp={layout['pp']}"
    return str(layout.get("backend", "hf"))


def save_checkpoint(
    root: Path,
    step: int,
    *,
    student: TrainStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: LoaderState,
    teachers: Sequence[TeacherIdentity],
    keep: int,
    world: DataParallel | None = None,
) -> Path:
    """Writes and publishes the checkpoint of `step`, then drops complete ones older than the last `keep`.

    Every rank of `world` calls it: the ranks that write a shard (`student.writes_checkpoint_shard`)
    write it into the temporary folder rank 0 made, and rank 0 publishes once they all have.
    """
    world = world or DataParallel()
    final = root / checkpoint_name(step)
    made = None
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        made = unique_temp_name(final)
        (made / "model").mkdir(parents=True)
    temp = Path(world.broadcast_object(str(made)))
    try:
        if student.writes_checkpoint_shard:
            student.save(temp / "model")
            save_file(_optimizer_tensors(optimizer), str(temp / optimizer_file(student.shard)))
        world.barrier()
        if world.rank == 0:
            _write_run_state(temp, step, student.layout, optimizer, scheduler, loader, teachers)
            if final.exists() and not (final / COMPLETE).exists():
                # A folder without its marker is not a checkpoint; move it aside (a temporary: garbage).
                final.rename(unique_temp_name(final))
            if not publish_dir(temp, final):
                raise MopdError(
                    f"checkpoint {final} already exists; another run writes into this output folder"
                )
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if world.rank == 0:
        _retain(root, step, keep)
    world.barrier()
    return final


def _write_run_state(
    folder: Path,
    step: int,
    layout: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: LoaderState,
    teachers: Sequence[TeacherIdentity],
) -> None:
    """The files every rank shares: RNG, state.json, the teacher list, then the COMPLETE marker."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    save_file(rng, str(folder / "rng.safetensors"))
    state = {
        "step": step,
        "loader": loader.to_dict(),
        "param_groups": optimizer.state_dict()["param_groups"],
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "layout": layout,
    }
    write_replace(folder / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
    write_teacher_list(folder, teachers)
    write_replace(folder / COMPLETE, json.dumps({"step": step, "time": time.time()}).encode())


def _retain(root: Path, step: int, keep: int) -> None:
    """Drops complete checkpoints older than the last `keep`, and this step's leftover temporaries."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    for stale in root.iterdir():
        if is_temporary(stale.name) and stale.name.startswith(checkpoint_name(step)):
            shutil.rmtree(stale, ignore_errors=True)


def read_state(folder: Path) -> dict[str, Any]:
    """A complete checkpoint's state.json (a checkpoint from before layouts were recorded is hf's)."""
    if not (folder / COMPLETE).exists():
        raise ConfigError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        state: dict[str, Any] = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder}/state.json is unreadable: {err}") from err
    state.setdefault("layout", {"backend": "hf"})
    return state


def load_checkpoint(
    folder: Path,
    *,
    student: TrainStudent,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> ResumePoint:
    """Restores model, optimizer, scheduler and RNG from `folder`; returns the step and loader state.

    Raises:
        ConfigError: not a complete checkpoint, or one of another layout than `student`'s.
    """
    state = read_state(folder)
    if state["layout"] != student.layout:
        raise ConfigError(
            f"cannot resume from {folder}: it was written by a {describe_layout(state['layout'])} student, "
            f"this run is {describe_layout(student.layout)} (train.backend, train.parallel); resume with "
            "the checkpoint's layout, or `mopd export-hf` it and start a new run from the exported student"
        )
    student.load_weights(folder / "model")
    tensors = load_file(str(folder / optimizer_file(student.shard)))
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        position, name = key.split(".", 1)
        slots.setdefault(int(position), {})[name] = value
    # Hyper-parameters from the run, parameter positions from this rank's own optimizer (its shard's).
    own = optimizer.state_dict()["param_groups"]
    groups = [
        {**g, "params": mine["params"], **({"betas": tuple(g["betas"])} if "betas" in g else {})}
        for g, mine in zip(state["param_groups"], own, strict=True)
    ]
    optimizer.load_state_dict({"state": slots, "param_groups": groups})
    scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * len(optimizer.param_groups)})
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return ResumePoint(step=int(state["step"]), loader=LoaderState.from_dict(state["loader"]))
