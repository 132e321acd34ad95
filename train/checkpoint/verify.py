"""`verify-manifest --checkpoint`: a training checkpoint is complete and unchanged, and was trained on
this store's teachers — read without torch (the command starts in a fraction of a second), from the
checkpoint's marker, teacher list and state.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd.base.completion import check_complete
from mopd.base.errors import MopdError
from mopd.base.jsonio import read_json
from mopd.store.format.manifest import Manifest
from mopd.store.format.teachers import diff_teacher_lists, read_teacher_list
from mopd.train.checkpoint.run_record import is_tokenizer_field, tokenizer_fields


def check_checkpoint(folder: Path, manifest: Manifest) -> list[str]:
    """Every way the checkpoint in `folder` is damaged or disagrees with the store of `manifest`, one
    line each: a file missing or changed since it was written, another store encoding, another teacher
    numbering."""
    try:
        problems = check_complete(folder)
        recorded = read_teacher_list(folder)
        state = _state(folder)
    except MopdError as err:
        return [str(err)]
    run = state.get("run") if isinstance(state, dict) else None
    trained_on = run.get("store.encoding", "(not recorded)") if isinstance(run, dict) else None
    if trained_on is not None and trained_on != manifest.storage.encoding:  # a run record to compare
        problems.append(
            f"{folder} was trained on a store of encoding {trained_on!r}, this store's is "
            f"{manifest.storage.encoding!r}: a resume on it is refused"
        )
    if isinstance(run, dict):
        problems += _tokenizer_problems(folder, run, manifest)
    return problems + diff_teacher_lists(
        manifest.teacher_list(), recorded, expected_name="store", found_name="checkpoint"
    )


def _shown(fingerprint: Any) -> str:
    return f"tokenizer fingerprint {str(fingerprint)[:12]}" if fingerprint else "no such tokenizer"


def _tokenizer_problems(folder: Path, run: dict[str, Any], manifest: Manifest) -> list[str]:
    """The tokenizers the checkpoint's run was aligned with (DESIGN §13) against the store's, one line
    for each that differs."""
    stored = tokenizer_fields(manifest)
    recorded = {name: value for name, value in run.items() if is_tokenizer_field(name)}
    return [
        f"{name}: {folder} was trained with {_shown(recorded.get(name))}, this store's rows are aligned with "
        f"{_shown(stored.get(name))}: a resume on it is refused"
        for name in sorted(set(stored) | set(recorded))
        if recorded.get(name) != stored.get(name)
    ]


def _state(folder: Path) -> Any:
    """The checkpoint's state.json as JSON (None: it has none)."""
    try:
        return read_json(folder / "state.json", what="checkpoint state", error=MopdError)
    except FileNotFoundError:
        return None
