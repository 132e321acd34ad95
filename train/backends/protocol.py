"""What the rest of training knows of a student backend: the `TrainStudent` operations on one rank, the
`StudentLayout` a checkpoint records, and the `Backend` entry points (`registry.backend(name)`).

Everything that differs between backends — how a checkpoint's weights and AdamW state are written and
read, how a checkpoint becomes one transformers model again, which optimizer a rank steps and how many
ranks share its moments, what of a parameter this rank holds — is an operation here, so that the
trainer, checkpoints, resume, export, the memory estimate and the precision check never ask which
backend runs. A new backend is one module of this folder with a `BACKEND`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from mopd.config.train import TrainConfig
from mopd.store.format.manifest import Manifest
from mopd.train.backends.groups import RankGroup

# What a backend writes into a checkpoint folder (the rest is the checkpoint's own: `checkpoint.state`).
MODEL_DIR = "model"  # a transformers checkpoint, or a sharded student's config and tokenizer only
SHARDED_STATE = "state"  # a sharded student's weights and AdamW state, every rank writing its part
OPTIMIZER_FILE = "optimizer.safetensors"  # a whole student's AdamW state

# (final hidden states of the trained tokens [N, H], this rank's output-layer shard, microbatch)
# -> (loss to back-propagate, anything the caller wants back)
LossFn = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]]

BackendName = Literal["hf", "fsdp", "megatron"]


class StudentLayout(BaseModel):
    """What a checkpoint's student must match to be resumed, or started from, by a run: its backend and
    the format of its weights. Not the rank count or tp × pp: the sharded formats are re-cut on load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: BackendName = "hf"
    format: str | None = None  # megatron: megatron-core's distributed checkpoint

    def describe(self) -> str:
        return self.backend + (" (any tp × pp)" if self.format else "")


class TrainStudent(Protocol):
    """What the trainer needs of a student backend (`HFStudent`, `FSDPStudent`, `MegatronStudent`) on
    one rank."""

    checkpoint: Path
    holds_loss: bool  # this rank computes the loss, so holds the teacher heads
    reports: bool  # this rank's per-token statistics count toward the step's metrics

    @property
    def output_rows(self) -> int: ...
    def vocab_slice(self, vocab: int) -> tuple[int, int]: ...
    @property
    def tp_group(self) -> Any: ...
    @property
    def layout(self) -> StudentLayout: ...
    @property
    def decoder_shape(self) -> tuple[int, int]: ...  # (hidden size, decoder layers on this rank)
    def parameters(self) -> list[torch.nn.Parameter]: ...
    def local_parameters(self) -> list[torch.Tensor]: ...  # each parameter's part on this rank
    def optimizer(self, *, lr: float, weight_decay: float) -> torch.optim.Optimizer: ...
    @property
    def optimizer_shards(self) -> int: ...  # ranks that share this rank's AdamW moments (ZeRO)
    def data_parallel(self) -> RankGroup: ...
    def train(self, mode: bool = True) -> None: ...
    def check_compatible(self, manifest: Manifest) -> None: ...
    def forward_backward(
        self, microbatches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list: ...
    def finish_gradients(self) -> None: ...
    def clip_gradients(self, max_norm: float) -> float: ...
    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None: ...
    def load_state(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    """A backend's entry points, for code that has a name or a checkpoint rather than a student."""

    # The student on this rank; what it starts (a model-parallel group) joins the exit stack.
    open_student: Callable[[TrainConfig, torch.device, RankGroup, ExitStack], TrainStudent]
    # A checkpoint's student, whole, as a transformers checkpoint in a folder (in `dtype`, by name).
    export_whole: Callable[[Path, str, Path], None]
    needs_process_group: bool = False  # even on one rank (a device mesh)


def student_dtype(tc: TrainConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[tc.dtype]


def parameter_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's groups as its state dict numbers them: hyper-parameters, and the positions of
    the group's parameters in the optimizer's order (read without gathering a sharded state)."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))}
        )
        start += count
    return groups
