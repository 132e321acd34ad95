"""The `megatron` teacher backend: megatron-core GPTModel teachers with tensor and pipeline parallelism.

Launch under torchrun (`torchrun --nproc-per-node N -m mopd.cli precompute CONFIG --backend megatron`).
The world splits into model-parallel groups of tp × pp ranks (`precompute.parallel`); each group is one
job of the task split (as `--num-tasks/--task-index` jobs are) and loads each of its teachers once,
converted from the HF checkpoint to this rank's shard (`mopd.mcore.convert`). Every rank of a group runs
every batch; the last pipeline stage's output is the final norm's output (the output layer is never
applied; under sequence parallelism, the ranks' shares of the sequence gathered), and that stage's first
tensor-parallel rank, the group's writer, writes the store. The other ranks never touch it. The LM head,
the logit transform and the capture check come from the checkpoint's transformers implementation cut to
one block, on the writer only, as in the vllm backend.

On a CPU (gloo), megatron-core runs through `mopd.mcore.cpu_compat`; on GPUs it runs as shipped (NCCL).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from mopd.mcore.cpu_compat import megatron_device
from mopd.mcore.parallel import ModelParallelGroup
from mopd.precompute.output_layer import CapturedModel, output_layer_only, resolve_dtype


class MegatronTeacher:
    """This rank's shard of a teacher (its pipeline stage, its tensor-parallel slice)."""

    name = "megatron"

    def __init__(
        self, checkpoint: str, *, group: ModelParallelGroup, dtype: str, trust_remote_code: bool
    ) -> None:
        from mopd.mcore.model import load_stage

        self.checkpoint = checkpoint
        self.group = group
        self.dtype = resolve_dtype(dtype, group.device)
        self.model, self.shape = load_stage(checkpoint, group, self.dtype, what=f"teacher {checkpoint}")
        self.hidden_size = self.shape.hidden_size
        self.model.requires_grad_(False)
        self.model.eval()
        self._reference: CapturedModel | None = None
        if group.is_lead:
            self._reference = output_layer_only(
                checkpoint, dtype=self.dtype, trust_remote_code=trust_remote_code
            )
            self.transform = self._reference.transform

    def _writer_part(self) -> CapturedModel:
        assert self._reference is not None, "only the group's writer holds the output layer"
        return self._reference

    def lm_head(self) -> torch.Tensor:
        return self._writer_part().lm_head()

    def check_capture(self, rows: Sequence[np.ndarray]) -> float:
        return self._writer_part().check_capture(rows)

    def hidden_states(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Every rank of the group runs each batch; the last stage returns each row's [L_i, H] states."""
        from megatron.core import parallel_state

        from mopd.mcore.model import activation_shape, stage_forward

        longest = max(len(r) for r in rows)
        input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for b, row in enumerate(rows):  # right padding: causal attention keeps real tokens exact
            input_ids[b, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
        device = self.group.device
        with torch.inference_mode(), megatron_device(device):
            if not self.group.is_first_stage:
                shape = activation_shape(self.model.config, batch=len(rows), length=longest)
                incoming = torch.empty(shape, dtype=self.dtype, device=device)
                dist.recv(incoming, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                self.model.set_input_tensor(incoming)
            output = stage_forward(self.model, input_ids.to(device), batch=len(rows), length=longest)
            if not self.group.is_last_stage:
                dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
                return []
        states = output.transpose(0, 1).to("cpu")
        return [states[b, : len(row)] for b, row in enumerate(rows)]

    def close(self) -> None:
        del self.model
        self._reference = None
