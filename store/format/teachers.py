"""Teacher indexing: which index means which teacher, and how two teacher lists differ (DESIGN §3).

Teacher index = position in the list of unique checkpoints sorted by normalised identifier. Aliases and
their order never influence numbering, so renaming or reordering aliases renumbers nothing. These are
pure functions; the store, the trainer's checkpoints and `verify-manifest` all compare lists with
`diff_teacher_lists`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from mopd.base.errors import ManifestError
from mopd.base.fsio import write_replace
from mopd.base.jsonio import read_json, validated

TEACHER_LIST_FILE = "teachers.json"


def normalise_checkpoint(checkpoint: str) -> str:
    """Absolute, symlink-free path for a local folder; other identifiers are kept verbatim."""
    path = Path(checkpoint).expanduser()
    if path.is_absolute() or path.exists():
        return os.path.realpath(path)
    return checkpoint


@dataclass(frozen=True)
class TeacherSlot:
    """One unique checkpoint: its index and every alias that names it (sorted)."""

    index: int
    checkpoint: str
    aliases: tuple[str, ...]


def assign_teacher_indices(teachers: Mapping[str, str]) -> list[TeacherSlot]:
    """Numbers the unique checkpoints of an alias → checkpoint mapping.

    Args:
        teachers: alias → checkpoint identifier (paths are normalised here).

    Returns:
        One slot per unique checkpoint, ordered by index (= sorted normalised identifier).
    """
    by_checkpoint: dict[str, list[str]] = {}
    for alias, checkpoint in teachers.items():
        by_checkpoint.setdefault(normalise_checkpoint(checkpoint), []).append(alias)
    return [
        TeacherSlot(index=i, checkpoint=ckpt, aliases=tuple(sorted(by_checkpoint[ckpt])))
        for i, ckpt in enumerate(sorted(by_checkpoint))
    ]


def alias_to_index(slots: Sequence[TeacherSlot]) -> dict[str, int]:
    return {alias: slot.index for slot in slots for alias in slot.aliases}


@dataclass(frozen=True)
class TeacherIdentity:
    """What a teacher index means: the checkpoint and, when known, its content fingerprint."""

    index: int
    checkpoint: str
    fingerprint: str | None = None

    def describe(self) -> str:
        fp = f" (fingerprint {self.fingerprint[:12]})" if self.fingerprint else ""
        return f"{self.checkpoint}{fp}"


def _same_teacher(a: TeacherIdentity, b: TeacherIdentity) -> bool:
    # A moved checkpoint with the same fingerprint is the same teacher; without fingerprints on both
    # sides, the path decides.
    if a.fingerprint and b.fingerprint:
        return a.fingerprint == b.fingerprint
    return a.checkpoint == b.checkpoint


def diff_teacher_lists(
    expected: Sequence[TeacherIdentity],
    found: Sequence[TeacherIdentity],
    *,
    expected_name: str = "store",
    found_name: str = "checkpoint",
) -> list[str]:
    """Every way `found` disagrees with `expected` about which teacher each index means.

    Returns:
        One message per difference (empty when the lists agree): renumbered, dropped and added
        teachers, and checkpoints whose fingerprint changed at the same path.
    """
    problems: list[str] = []
    unmatched_found = list(found)
    for teacher in expected:
        match = next((f for f in unmatched_found if _same_teacher(teacher, f)), None)
        if match is None:
            same_path = next((f for f in unmatched_found if f.checkpoint == teacher.checkpoint), None)
            if same_path is not None:
                unmatched_found.remove(same_path)
                problems.append(
                    f"teacher {teacher.index} ({teacher.checkpoint}): fingerprint changed at the same path: "
                    f"{expected_name} has {teacher.fingerprint}, {found_name} has {same_path.fingerprint}"
                )
            else:
                problems.append(
                    f"teacher {teacher.index} ({teacher.describe()}) is in the {expected_name} "
                    f"but dropped from the {found_name}"
                )
            continue
        unmatched_found.remove(match)
        if match.index != teacher.index:
            problems.append(
                f"teacher {teacher.describe()} is renumbered: index {teacher.index} in the {expected_name}, "
                f"{match.index} in the {found_name}"
            )
    for extra in unmatched_found:
        problems.append(
            f"teacher {extra.index} ({extra.describe()}) is added in the {found_name}; "
            f"the {expected_name} does not have it"
        )
    return problems


def write_teacher_list(folder: Path, teachers: Sequence[TeacherIdentity]) -> Path:
    """Writes, atomically, the teacher list a training checkpoint records (JSON, sorted keys)."""
    path = folder / TEACHER_LIST_FILE
    payload = [{"index": t.index, "checkpoint": t.checkpoint, "fingerprint": t.fingerprint} for t in teachers]
    write_replace(path, (json.dumps({"teachers": payload}, indent=2, sort_keys=True) + "\n").encode())
    return path


class _ListedTeacher(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: Annotated[StrictInt, Field(ge=0)]
    checkpoint: StrictStr
    fingerprint: StrictStr | None = None


class _TeacherList(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    teachers: list[_ListedTeacher]


def read_teacher_list(folder: Path) -> list[TeacherIdentity]:
    """Reads the teacher list recorded in a training checkpoint folder.

    Raises:
        ManifestError: the file is missing or malformed.
    """
    path = folder / TEACHER_LIST_FILE
    try:
        raw = read_json(path, what="teacher list", error=ManifestError)
    except FileNotFoundError as err:
        raise ManifestError(
            f"{path} not found: {folder} is not a mopd training checkpoint (it records no teacher list)"
        ) from err
    listed = validated(_TeacherList, raw, what=f"{path}: malformed teacher list", error=ManifestError)
    return [TeacherIdentity(t.index, t.checkpoint, t.fingerprint) for t in listed.teachers]
