"""The `fsdp` student: the `hf` backend's transformers student sharded over the data-parallel ranks with
FSDP2, each rank holding 1/W of its parameters, gradients and AdamW state (units: docs/internals.md).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mopd.base import faults
from mopd.base.errors import ConfigError
from mopd.config.train import TrainConfig
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.hf import (
    FinalStates,
    HFStudent,
    final_states,
    load_student_tokenizer,
    save_tokenizer,
)
from mopd.train.backends.protocol import MODEL_DIR, SHARDED_STATE, Backend, StudentLayout, student_dtype


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder blocks (the backbone's `layers`, as every Llama-style transformers model
    names them)."""
    blocks = getattr(model.base_model, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ConfigError(
            f"train.backend fsdp: {type(model).__name__} keeps no decoder blocks in `layers`; the fsdp "
            "backend shards Llama-style transformers models (Llama, Qwen2/3, Mistral, SmolLM)"
        )
    return blocks


def shard_mesh(world: RankGroup, replicate: int, device: torch.device) -> Any:
    """The device mesh: 1-D over the world, or (replicate, shard) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if world.size % replicate:
        raise ConfigError(
            f"train.parallel.dp_replicate {replicate} does not divide the world size {world.size}: each "
            "replica shards the student over world / dp_replicate ranks"
        )
    if replicate == 1:
        return init_device_mesh(device.type, (world.size,))
    return init_device_mesh(
        device.type, (replicate, world.size // replicate), mesh_dim_names=("replicate", "shard")
    )


class FSDPStudent(HFStudent):
    """This rank's shards of a transformers student (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        dp: RankGroup,
        replicate: int = 1,
        sync_every_microbatch: bool = True,
        mixed_precision: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        # Loaded whole on the host, then each unit moves only its own shard to the device.
        super().__init__(
            checkpoint,
            device=torch.device("cpu"),
            dtype=dtype,
            dp=dp,
            activation_checkpointing=activation_checkpointing,
        )
        self.device = device
        self.sync_every_microbatch = sync_every_microbatch
        mesh = shard_mesh(dp, replicate, device)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        model = self.model
        # The backbone's output as a forward method of the model, so that FSDP gathers the root unit
        # around it.
        model.final_states = types.MethodType(final_states, model)
        units = [fully_shard(block, mesh=mesh, mp_policy=policy) for block in decoder_blocks(model)]
        embed, output = model.get_input_embeddings(), model.get_output_embeddings()
        tied = output.weight is embed.weight
        head_modules = [embed, output] if tied else [output]
        fully_shard(head_modules, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        self.head_unit = output  # the unit's handle (every module of a unit is one)
        units.append(output)
        if not tied:
            units.append(fully_shard(embed, mesh=mesh, mp_policy=policy))
        units.append(fully_shard(model, mesh=mesh, mp_policy=policy))
        register_fsdp_forward_method(model, "final_states")
        self.trunk = model.final_states
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # the loss is normalised already: sum, never average
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum

    def replicate(self, trunk: FinalStates) -> FinalStates:
        """Nothing yet: the constructor shards the model once it is loaded."""
        return trunk

    @property
    def layout(self) -> StudentLayout:
        """What a checkpoint of this student must match to be resumed by it: not the rank count (the
        shards are re-cut on load)."""
        return StudentLayout(backend="fsdp")

    def local_parameters(self) -> list[torch.Tensor]:
        """Each parameter's shard on this rank (a DTensor's local part)."""
        from torch.distributed.tensor import DTensor

        return [cast(DTensor, p).to_local() for p in self.parameters()]

    def whole_head(self) -> torch.Tensor:
        """The output layer's whole weight, gathered (a no-op while it already is)."""
        self.head_unit.unshard()
        return self.head

    def microbatch_count(self, held: int, *, forward_only: bool) -> int:
        """The most microbatches any rank holds: every forward gathers weights from every rank."""
        return int(self.dp.all_reduce(torch.tensor([held]), op=dist.ReduceOp.MAX)[0])

    @contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Gradients reduce-scattered in this microbatch's backward if `sync` (the step's last one) or
        after every microbatch (`gradient_sync: microbatch`)."""
        self.model.set_requires_gradient_sync(sync or self.sync_every_microbatch)
        yield

    def loss_head(self) -> torch.Tensor:
        return self.whole_head()

    def after_microbatches(self) -> None:
        """Every unit back to its shard: a backward reshards them itself, a forward alone leaves the
        head and the root unit gathered."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def finish_gradients(self) -> None:
        """Nothing: the backward of the step's last microbatch reduce-scattered every gradient."""

    def clip_gradients(self, max_norm: float) -> float:
        """Clips the global gradient norm (over every rank's shards) to `max_norm`; returns it before."""
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def save(self, folder: Path) -> None:
        """The student's config and tokenizer (rank 0): what `mopd export-hf` builds the model from; the
        weights are in the checkpoint's sharded state."""
        if self.dp.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(folder)
            save_tokenizer(self.tokenizer, folder)

    def state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The model's (and `optimizer`'s) state as this rank's shards, keyed by transformers names."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, optimizer)
        return state

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """The config and tokenizer (`model/`), and every rank's shards of the weights and AdamW state in
        `state/` (torch's distributed checkpoint: one file per rank and a `.metadata` index). Every rank
        calls it."""
        import torch.distributed.checkpoint as dcp

        with faults.io("write", folder / MODEL_DIR):
            self.save(folder / MODEL_DIR)
        with faults.io("write", folder / SHARDED_STATE):
            dcp.save(self.state(optimizer), checkpoint_id=folder / SHARDED_STATE)
        faults.point("checkpoint-shards-written")

    def load_state(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> None:
        """Loads `save_state`'s shards into this layout's (any rank count: the shards are re-cut),
        bit-exact; the optimizer's learning rate and other hyper-parameters come back too."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = self.state(optimizer)
        dcp.load(state, checkpoint_id=folder / SHARDED_STATE)
        set_model_state_dict(self.model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(self.model, optimizer, state["optimizer"])


def open_student(tc: TrainConfig, device: torch.device, world: RankGroup, exits: ExitStack) -> FSDPStudent:
    """The student sharded over the ranks of `world` (replicated over `train.parallel.dp_replicate`
    groups of them)."""
    return FSDPStudent(
        tc.student,
        device=device,
        dtype=student_dtype(tc),
        dp=world,
        replicate=tc.parallel.dp_replicate,
        sync_every_microbatch=tc.parallel.gradient_sync == "microbatch",
        mixed_precision=tc.mixed_precision == "bf16",
        activation_checkpointing=tc.activation_checkpointing,
    )


def export_whole(checkpoint: Path, dtype: str, folder: Path) -> None:
    """The whole student from the checkpoint's shards, read in this one process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint / MODEL_DIR)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process reading every shard is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint / SHARDED_STATE, no_dist=True)
    model.load_state_dict(state["model"])
    model.save_pretrained(folder)
    save_tokenizer(load_student_tokenizer(checkpoint / MODEL_DIR), folder)


BACKEND = Backend(open_student=open_student, export_whole=export_whole, needs_process_group=True)
