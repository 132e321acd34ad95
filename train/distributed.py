"""Groups of a training run's ranks: the world (torchrun's environment, or an already initialised group)
and the student's data-parallel replicas (the world on the hf backend; one rank of each model-parallel
group on the megatron backend).

Gradients are summed across ranks once per optimiser step, after every microbatch of the step has run
its backward, in one flat all-reduce per bucket. The loss is normalised by the global trained-token
count beforehand, so the sum is the exact gradient of the global batch — also when ranks hold different
numbers of microbatches (which a per-backward DDP hook schedule cannot allow).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_BUCKET_ELEMENTS = 1 << 24  # 64 MiB of fp32 per all-reduce


@dataclass
class RankGroup:
    """Some ranks of the run and this process's place among them; on one rank every collective is a
    no-op. `group` None is the default (world) process group."""

    rank: int = 0
    size: int = 1
    group: Any = None
    owns_group: bool = False

    @classmethod
    def from_environment(cls, device: torch.device, *, always: bool = False) -> RankGroup:
        """The default process group: the one already initialised, or one from torchrun's variables.
        Outside torchrun there is none, unless `always` asks for a world of one (for engines that need
        a process group even on one rank, FSDP's)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        backend = "nccl" if device.type == "cuda" else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            if not always:
                return cls()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return cls(owns_group=True)
        dist.init_process_group(backend)
        return cls(dist.get_rank(), dist.get_world_size(), owns_group=True)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group)
        return tensor

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sums every parameter's gradient over the ranks (a missing gradient counts as zeros)."""
        if self.enabled:
            sum_gradients(parameters, self.group)

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

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Destroys the process group where `from_environment` made it (a second call does nothing)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def sum_gradients(parameters: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Sums the parameters' gradients over the ranks of `group` (a missing gradient counts as zeros),
    in one flat all-reduce per bucket."""
    buckets: list[list[torch.Tensor]] = []
    filled = _BUCKET_ELEMENTS
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if filled >= _BUCKET_ELEMENTS:
            buckets.append([])
            filled = 0
        buckets[-1].append(p.grad)
        filled += p.grad.numel()
    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
