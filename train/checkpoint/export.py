"""`mopd export-hf`: a training checkpoint's student as a transformers checkpoint.

The checkpoint's layout names the backend that wrote it, and that backend rebuilds the whole student
(`Backend.export_whole`): an hf checkpoint's `model/` is one already, an fsdp checkpoint's shards are
read whole in this one process, a megatron checkpoint is loaded at tp = pp = 1 and converted to the
student's own architecture.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mopd.base.errors import ConfigError, MopdError
from mopd.base.fsio import publish_dir, unique_temp_name
from mopd.train.backends.registry import backend
from mopd.train.checkpoint.state import latest_checkpoint, read_state


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a complete checkpoint, else the latest complete one of a run folder."""
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(f"{path} is neither a complete checkpoint nor a run folder holding one")
    return found


def export_hf(checkpoint: Path, output: Path) -> Path:
    """Writes the student of `checkpoint` (or of a run folder's latest checkpoint) to `output`, a new
    folder that transformers' `from_pretrained` loads. Returns the checkpoint exported.

    Raises:
        ConfigError: no complete checkpoint there, or `output` exists.
        CheckpointError: a checkpoint of a format this version does not read.
    """
    checkpoint = resolve_checkpoint(Path(checkpoint))
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"export: {output} already exists and is not empty; choose a new folder")
    state = read_state(checkpoint)
    temp = unique_temp_name(output)
    temp.mkdir(parents=True)
    try:
        dtype = str(state.run.get("train.dtype", "float32"))
        backend(state.layout.backend).export_whole(checkpoint, dtype, temp)
        if output.exists():
            output.rmdir()  # empty (checked above)
        if not publish_dir(temp, output):
            raise MopdError(f"export: {output} was created by someone else meanwhile")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return checkpoint
