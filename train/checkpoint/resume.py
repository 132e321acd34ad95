"""Where a training run starts, decided in one place: from its own latest checkpoint (a resume), from
the checkpoint `train.init_from` names (a new run on its weights), or from the student itself.

Each checkpoint's state is read once, and every refusal lives here, each naming what differs: a
checkpoint folder a `--no-resume` run would overwrite, a damaged file, another store's teacher list,
another student layout, another store or setting (the run record, `run_record.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mopd.base.completion import check_complete
from mopd.base.errors import CheckpointError, ConfigError, ManifestError
from mopd.config.train import InitFromConfig
from mopd.store.format.teachers import TeacherIdentity, diff_teacher_lists, read_teacher_list
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.protocol import StudentLayout
from mopd.train.checkpoint.run_record import RunRecord, diff_run_records
from mopd.train.checkpoint.state import (
    CheckpointState,
    latest_checkpoint,
    read_state,
    remove_temporaries,
)

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed by this run."""

    store: Path | str  # the store's folder or URL, for messages
    teachers: list[TeacherIdentity]  # the store's teacher list
    run: RunRecord  # the store's identity and every recorded setting
    layout: StudentLayout  # the student's backend and checkpoint format


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint whose files match their marker, and its state."""

    folder: Path
    state: CheckpointState


def resume_checkpoint(
    root: Path,
    *,
    resume: bool | None,
    identity: RunIdentity,
    world: RankGroup,
    log: Log,
) -> Checkpoint | None:
    """The checkpoint under `root` this run resumes from, or None for a run from the start. Rank 0
    first removes what killed saves left there.

    Args:
        resume: False refuses a folder that holds checkpoints; None and True resume the latest.
        identity: what the checkpoint must match.

    Raises:
        ConfigError: checkpoints exist under `resume=False`, or another student layout.
        CheckpointError: a damaged file, or another store or setting.
        ManifestError: the store's teacher list differs from the checkpoint's.
    """
    if world.rank == 0:
        stale = remove_temporaries(root)
        if stale:
            log(f"removed {len(stale)} unfinished checkpoint save(s): {', '.join(stale)}")
    world.barrier()
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    if resume is False:
        raise ConfigError(
            f"{root.parent} already holds checkpoints (latest {latest.name}); pass --resume to continue "
            "that run, or choose another --output"
        )
    check_files(latest, world)
    problems = diff_teacher_lists(identity.teachers, read_teacher_list(latest))
    if problems:
        raise ManifestError(
            f"cannot resume from {latest}: its teacher list differs from the store {identity.store}:\n  "
            + "\n  ".join(problems)
        )
    state = read_state(latest)
    check_layout(latest, state, identity.layout, doing="resume from")
    changed = diff_run_records(state.run, identity.run)
    if changed:
        raise CheckpointError(
            f"cannot resume from {latest}: it was trained on another store or with other settings:\n  "
            + "\n  ".join(changed)
            + "\nrestore them, or start a new run from that checkpoint with `train.init_from`"
        )
    return Checkpoint(latest, state)


def init_checkpoint(init: InitFromConfig, *, layout: StudentLayout, world: RankGroup) -> Checkpoint:
    """The checkpoint `train.init_from` names: a checkpoint folder, or a run folder's newest.

    Raises:
        ConfigError: neither, or a checkpoint of another student layout.
        CheckpointError: a damaged file.
    """
    folder = latest_checkpoint(Path(init.checkpoint))
    if folder is None:
        raise ConfigError(
            f"train.init_from: {init.checkpoint} is neither a complete checkpoint nor a run folder "
            "holding one"
        )
    check_files(folder, world)
    state = read_state(folder)
    check_layout(folder, state, layout, doing="start from")
    return Checkpoint(folder, state)


def check_files(folder: Path, world: RankGroup) -> None:
    """Rank 0 hashes the checkpoint's files against its marker; every rank raises what it found.

    Raises:
        CheckpointError: naming each file missing, truncated or changed since it was written.
    """
    problem = None
    if world.rank == 0:
        try:
            problems = check_complete(folder)
            if problems:
                problem = f"checkpoint {folder} is damaged:\n  " + "\n  ".join(problems)
        except CheckpointError as err:  # no readable marker
            problem = str(err)
    problem = world.broadcast_object(problem)
    if problem is not None:
        raise CheckpointError(problem)


def check_layout(folder: Path, state: CheckpointState, layout: StudentLayout, *, doing: str) -> None:
    """Refuses a checkpoint written by a student of another layout (`StudentLayout`)."""
    if state.layout != layout:
        raise ConfigError(
            f"cannot {doing} {folder}: it was written by a {state.layout.describe()} student, "
            f"this run is {layout.describe()} (train.backend, train.parallel); use the "
            "checkpoint's layout, or `mopd export-hf` it and start a new run from the exported student"
        )
