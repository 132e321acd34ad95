"""Groups of a training run's ranks: the world (torchrun's environment, or an already initialised group)
and the student's data-parallel replicas (the world on the hf backend; one rank of each model-parallel
group on the megatron backend). The engines reduce the gradients over the replicas: torch's
DistributedDataParallel (`hf`), FSDP2 (`fsdp`), megatron-core's DistributedDataParallel (`megatron`).

(No `from __future__ import annotations` here: DistributedDataParallel checks its communication hook's
annotations as objects, not strings.)
"""

import os
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist

from mopd.mcore.parallel import start_process_group


@dataclass
class RankGroup:
    """Some ranks of the run and this process's place among them; on one rank every collective is a
    no-op. `group` None is the default (world) process group."""

    rank: int = 0
    size: int = 1
    group: Any = None
    owns_group: bool = False

    @classmethod
    def from_environment(cls, device: torch.device, *, always: bool = False) -> Self:
        """The default process group: the one already initialised, or one from torchrun's variables.
        Outside torchrun there is none, unless `always` asks for a world of one (for engines that need
        a process group even on one rank, FSDP's)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not always:
            return cls()
        start_process_group(device)
        return cls(dist.get_rank(), dist.get_world_size(), owns_group=True)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (picklable objects only)."""
        if not self.enabled:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """`value` of rank `src`, on every rank (picklable objects only)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Destroys the process group where `from_environment` made it (a second call does nothing)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def sum_over_ranks(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DistributedDataParallel communication hook: one bucket of gradients summed over `group` (the
    default hook averages them; mopd's loss is normalised by the global batch already)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
