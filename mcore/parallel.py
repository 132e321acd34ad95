"""torchrun's world split into megatron-core's tp × pp model-parallel groups, for teachers and students."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.base.errors import ConfigError, MopdError
from mopd.config.parallel import ParallelConfig


@dataclass(frozen=True)
class ModelParallelGroup:
    """This rank's place in the world: its tp × pp model-parallel group, stage, slice and replica.

    It owns megatron-core's model-parallel state (and the process group, where `start` made one): used as
    a context manager, or closed with `close`, it leaves neither behind on any exit path, so the next
    stage of the same process starts its own layout.
    """

    device: torch.device
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp_size: int
    lead_rank: int  # global rank of the last stage's first tensor-parallel rank
    sequence_parallel: bool = False  # activations outside attention and MLP split over the TP ranks
    owns_process_group: bool = False  # `start` made the process group (a world of one, no torchrun)

    @property
    def is_lead(self) -> bool:
        """This rank is its group's lead: the one that writes or reports for the whole group."""
        return dist.get_rank() == self.lead_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @classmethod
    def start(cls, parallel: ParallelConfig, device: torch.device, *, what: str) -> ModelParallelGroup:
        """Joins torchrun's process group (or makes a one-rank one) and megatron-core's parallel state, on
        this process's `device` (`store.devices.rank_device`).

        Raises:
            ConfigError: the world size is not a multiple of tp × pp, or megatron-core is missing.
        """
        try:
            from megatron.core import parallel_state
        except ImportError as err:
            raise ConfigError(
                f"the megatron backend needs megatron-core ({err}); pip install 'mopd[megatron]'"
            ) from err
        if parallel_state.model_parallel_is_initialized():
            # Another stage of this process (precompute before training in `mopd rounds`, say) left its
            # layout behind: reusing it would run this stage at that layout, whatever `what` says.
            live_tp = parallel_state.get_tensor_model_parallel_world_size()
            live_pp = parallel_state.get_pipeline_model_parallel_world_size()
            raise MopdError(
                f"{what} tp={parallel.tp} × pp={parallel.pp}: megatron-core's model-parallel state is "
                f"already initialised in this process (tp={live_tp} × pp={live_pp}) by a stage that did "
                "not close its ModelParallelGroup"
            )
        owns = start_process_group(device)
        try:
            return cls._join(parallel, device, what=what, owns=owns)
        except BaseException:
            if owns:
                dist.destroy_process_group()
            raise

    @classmethod
    def _join(
        cls, parallel: ParallelConfig, device: torch.device, *, what: str, owns: bool
    ) -> ModelParallelGroup:
        from megatron.core import parallel_state

        world = dist.get_world_size()
        if world % (parallel.tp * parallel.pp):
            raise ConfigError(
                f"{what} tp={parallel.tp} × pp={parallel.pp} does not divide the {world} ranks; launch "
                "a multiple of tp × pp processes"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp
        )
        try:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            places: list[Any] = [None] * parallel.tp * parallel.pp
            dist.all_gather_object(
                places, (dist.get_rank(), tp_rank, pp_rank), group=parallel_state.get_model_parallel_group()
            )
        except BaseException:
            parallel_state.destroy_model_parallel()
            raise
        lead = next(rank for rank, t, p in places if t == 0 and p == parallel.pp - 1)
        return cls(
            device=device,
            tp=parallel.tp,
            pp=parallel.pp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            lead_rank=lead,
            sequence_parallel=parallel.sequence_parallel,
            owns_process_group=owns,
        )

    def close(self) -> None:
        """Leaves megatron-core's parallel state, and the process group where `start` made it."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> ModelParallelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_world(self) -> None:
        """Returns once every rank of the world has reached this point (every group's work is done)."""
        dist.barrier()

    def share(self, items: list[Any]) -> list[Any]:
        """The lead's `items`, on every rank of the model-parallel group."""
        from megatron.core import parallel_state

        box = [items if self.is_lead else None]
        dist.broadcast_object_list(box, src=self.lead_rank, group=parallel_state.get_model_parallel_group())
        return list(box[0] or [])


def start_process_group(device: torch.device, *, alone: bool = False) -> bool:
    """Starts the default process group unless one is up: from torchrun's variables when a launcher set a
    world of several ranks, else (or with `alone`) a world of this process only. Returns whether it
    started one: its starter destroys it.

    The one place mopd starts a process group (the trainer's ranks, megatron-core's layout, the export).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not alone and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)
        if backend == "gloo":
            # Every rank has finished gloo's handshake before any goes on: a rank that fails at once
            # (a missing store) and exits would otherwise close its end while a peer is still
            # connecting, and that peer dies with "Connection closed by peer" instead of its own error.
            dist.barrier()
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True
