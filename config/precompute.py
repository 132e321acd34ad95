"""What `mopd precompute` reads: the dataset, how its rows route to teachers, and how teachers run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mopd.base.section import Section
from mopd.config.parallel import ParallelConfig


class RoutingConfig(Section):
    """How a row's metadata column picks its teacher alias."""

    field: str = "agent"
    # agent -> alias; empty means every alias routes the agent of the same name.
    teacher_by_agent: dict[str, str] = Field(default_factory=dict)
    default_teacher: str | None = None


class DataConfig(Section):
    path: str
    max_length: int = Field(2048, gt=0)
    # Rows longer than max_length: cut to max_length ("truncate") or left out ("drop").
    overlong: Literal["truncate", "drop"] = "truncate"
    # Processes that tokenise the dataset (once per store: later jobs read the ingest cache). Default:
    # the machine's cores, at most 8; datasets under 10k rows per process tokenise in one.
    num_proc: int | None = Field(None, ge=1)


class PrecomputeConfig(Section):
    backend: Literal["hf", "vllm", "megatron"] = "hf"
    # Padded tokens per forward batch (rows × longest row).
    batch_tokens: int = Field(16384, gt=0)
    device: str = "auto"
    # Teacher compute dtype; auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Rows of one teacher per task (the unit of resumption and of splitting across jobs).
    rows_per_task: int = Field(1024, gt=0)
    trust_remote_code: bool = False
    # Teacher tensor/pipeline parallelism (megatron backend, under torchrun).
    parallel: ParallelConfig = ParallelConfig()
