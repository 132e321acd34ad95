"""`mopd export-hf`: a training checkpoint's student as a transformers checkpoint.

An hf-backend checkpoint already holds one (`model/`), which is copied. An fsdp-backend checkpoint
holds its shards as torch's distributed checkpoint, read whole in this one process. A megatron-backend
checkpoint holds megatron-core's distributed checkpoint: it loads into a one-rank GPTModel (tp = pp =
1, megatron-core re-cutting the slices) whose weights mopd's conversion
(`mopd.mcore.convert.megatron_to_hf`, bit-exact, vocabulary padding dropped) turns into the student's own
architecture; earlier mopd versions wrote one weights file per tensor-parallel slice and pipeline stage
instead, which the same conversion joins.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import load_file

from mopd.base.errors import ConfigError, MopdError
from mopd.base.fsio import publish_dir, unique_temp_name
from mopd.train.backends.hf import load_student_tokenizer, save_tokenizer
from mopd.train.checkpoint.state import (
    SHARDED_STATE,
    latest_checkpoint,
    read_state,
)


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a complete checkpoint, else the latest complete one of a run folder."""
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(f"{path} is neither a complete checkpoint nor a run folder holding one")
    return found


def _join_megatron_shards(model_dir: Path, tp: int, pp: int, folder: Path) -> None:
    """An earlier mopd's megatron checkpoint: `model/tpXX-ppYY.safetensors` per slice and stage."""
    from transformers import AutoConfig

    from mopd.mcore.convert import GPTShape, megatron_to_hf

    shape = GPTShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    names = [[f"tp{t:02d}-pp{p:02d}" for t in range(tp)] for p in range(pp)]
    missing = [name for stage in names for name in stage if not (model_dir / f"{name}.safetensors").exists()]
    if missing:
        raise ConfigError(f"{model_dir}: shards {', '.join(missing)} of tp={tp} × pp={pp} are missing")
    stages = [[load_file(str(model_dir / f"{name}.safetensors")) for name in stage] for stage in names]
    _save_converted(
        megatron_to_hf(stages, shape, layers_per_stage=[shape.num_layers // pp] * pp), model_dir, folder
    )


def _gather_megatron_state(checkpoint: Path, dtype: str, folder: Path) -> None:
    """The whole student from megatron-core's distributed checkpoint, loaded at tp = pp = 1 here."""
    import torch
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from mopd.config.parallel import ParallelConfig
    from mopd.mcore.convert import GPTShape, megatron_to_hf
    from mopd.mcore.cpu_compat import install_cpu_rng_tracker, megatron_device
    from mopd.mcore.model import gpt_model, load_state
    from mopd.mcore.parallel import ModelParallelGroup

    shape = GPTShape.from_hf_config(AutoConfig.from_pretrained(checkpoint / "model"))
    cpu = torch.device("cpu")
    with (
        _world_of_one(),
        ModelParallelGroup.start(ParallelConfig(), cpu, what="export-hf"),
        megatron_device(cpu),
    ):
        install_cpu_rng_tracker()
        model = gpt_model(shape, tp=1, pp=1, dtype=getattr(torch, dtype), pre_process=True, post_process=True)
        load_state(
            model,
            dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint / SHARDED_STATE))[
                "model"
            ],
        )
        weights = {
            k: v
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")
        }
    _save_converted(
        megatron_to_hf([[weights]], shape, layers_per_stage=[shape.num_layers]), checkpoint / "model", folder
    )


@contextmanager
def _world_of_one() -> Iterator[None]:
    """A process group of this process alone (also inside torchrun's environment: the export runs on
    one rank, after the run's own group is gone), unless one is already up."""
    import torch
    import torch.distributed as dist

    from mopd.mcore.parallel import start_process_group

    owns = start_process_group(torch.device("cpu"), alone=True)
    try:
        yield
    finally:
        if owns:
            dist.destroy_process_group()


def _save_converted(state: dict, model_dir: Path, folder: Path) -> None:
    """Converted HF weights as the student's own architecture (config and tokenizer from `model_dir`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mopd.mcore.convert import GPTShape

    config = AutoConfig.from_pretrained(model_dir)
    shape = GPTShape.from_hf_config(config)
    dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing_keys, unexpected = model.load_state_dict(state, strict=False)
    untied = [k for k in missing_keys if not (shape.tied and k == "lm_head.weight")]
    if untied or unexpected:
        raise MopdError(
            f"{model_dir}: joined weights do not fit {config.model_type} ({untied[:3]}, {unexpected[:3]})"
        )
    if shape.tied:
        model.tie_weights()
    model.save_pretrained(folder)
    save_tokenizer(load_student_tokenizer(model_dir), folder)


def _gather_fsdp_shards(checkpoint: Path, dtype: str, folder: Path) -> None:
    """The whole student from an fsdp checkpoint's shards (read in one process, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint / "model")
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process reading every shard is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint / SHARDED_STATE, no_dist=True)
    model.load_state_dict(state["model"])
    model.save_pretrained(folder)
    save_tokenizer(load_student_tokenizer(checkpoint / "model"), folder)


def export_hf(checkpoint: Path, output: Path) -> Path:
    """Writes the student of `checkpoint` (or of a run folder's latest checkpoint) to `output`, a new
    folder that transformers' `from_pretrained` loads. Returns the checkpoint exported.

    Raises:
        ConfigError: no complete checkpoint there, `output` exists, or shards are missing.
    """
    checkpoint = resolve_checkpoint(Path(checkpoint))
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"export: {output} already exists and is not empty; choose a new folder")
    state = read_state(checkpoint)
    layout = state.layout
    temp = unique_temp_name(output)
    temp.mkdir(parents=True)
    try:
        if layout["backend"] == "megatron" and "tp" in layout:  # an earlier mopd's per-slice files
            _join_megatron_shards(checkpoint / "model", int(layout["tp"]), int(layout["pp"]), temp)
        elif layout["backend"] == "megatron":
            _gather_megatron_state(checkpoint, str(state.run.get("train.dtype", "float32")), temp)
        elif layout["backend"] == "fsdp":
            _gather_fsdp_shards(checkpoint, str(state.run.get("train.dtype", "float32")), temp)
        else:
            shutil.copytree(checkpoint / "model", temp, dirs_exist_ok=True)
        if output.exists():
            output.rmdir()  # empty (checked above)
        if not publish_dir(temp, output):
            raise MopdError(f"export: {output} was created by someone else meanwhile")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return checkpoint
