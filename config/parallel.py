"""The model-parallel layout of a teacher (`precompute.parallel`) or a student (`train.parallel`), read by
`mopd.mcore`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mopd.base.section import Section


class ParallelConfig(Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    # Split the sequence over the tensor-parallel ranks outside attention and MLP (megatron backend).
    sequence_parallel: bool = False

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                "sequence_parallel splits the sequence over the tensor-parallel ranks: it needs tp ≥ 2"
            )
        return self


class StudentParallelConfig(ParallelConfig):
    """`train.parallel`: the teacher's layout settings, and how the fsdp backend shards."""

    # fsdp backend: shard the student within groups of world / dp_replicate ranks (a node, say) and
    # replicate it across the groups (HSDP); 1 shards over the whole world.
    dp_replicate: int = Field(1, ge=1)
    # fsdp backend: reduce-scatter the gradients after every microbatch's backward (each rank keeps
    # only its shard of them), or once a step, after the last (less communication, but every rank holds
    # the whole unsharded gradient, fp32, through the step).
    gradient_sync: Literal["microbatch", "step"] = "microbatch"
