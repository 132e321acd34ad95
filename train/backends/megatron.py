"""A megatron-core GPTModel student: this rank's pipeline stage and tensor-parallel slice.

Built from an HF Llama/Qwen2-family checkpoint by mopd's own conversion (`mopd.mcore.convert`). The
loss never runs the student's output layer: on the last stage, the final norm's output and this rank's
vocabulary shard of the output layer go to the fused divergence kernels with the tensor-parallel group,
as in the hf backend. Microbatches go through megatron-core's pipeline schedules
(`forward_backward`), which also run the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mopd.base import faults
from mopd.base.errors import ConfigError, MopdError
from mopd.config.train import TrainConfig
from mopd.mcore.cpu_compat import megatron_device
from mopd.mcore.model import load_stage, load_state, release_checkpoint_writer, stage_forward
from mopd.mcore.parallel import ModelParallelGroup
from mopd.store.format.manifest import Manifest
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.hf import check_tokenizer, load_student_tokenizer, save_tokenizer
from mopd.train.backends.protocol import (
    MODEL_DIR,
    SHARDED_STATE,
    Backend,
    LossFn,
    StudentLayout,
    parameter_groups,
    student_dtype,
)


class MegatronStudent:
    """This rank's part of the student; every rank of a model-parallel group holds one.

    Only the last pipeline stage computes the loss (`holds_loss`), and of its tensor-parallel ranks,
    which all see the same per-token values, the first one reports them (`reports`).
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        group: ModelParallelGroup,
        dtype: torch.dtype,
        mixed_precision: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        self.compute_dtype = torch.bfloat16 if mixed_precision else None
        self.checkpoint = Path(checkpoint)
        if not self.checkpoint.is_dir():
            raise ConfigError(f"train.student: {self.checkpoint} is not a checkpoint folder")
        self.group = group
        self.model, self.shape = load_stage(
            self.checkpoint,
            group,
            dtype,
            what="train.student",
            recompute=activation_checkpointing,
            compute_dtype=self.compute_dtype,
        )
        self.layers_per_stage = self.shape.num_layers // group.pp
        self.model.train()
        self.replicas = _data_parallel(self.model, group.device)
        self.holds_loss = group.is_last_stage
        self.reports = group.is_last_stage and group.tp_rank == 0
        self.tokenizer = load_student_tokenizer(self.checkpoint)

    @property
    def layout(self) -> StudentLayout:
        """What a checkpoint of this student must match to be resumed by it: not tp × pp (megatron-core's
        distributed checkpoint re-cuts the tensors for the layout that loads it)."""
        return StudentLayout(backend="megatron", format=DIST_CHECKPOINT)

    @property
    def tp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    @property
    def output_rows(self) -> int:
        """Rows of the student's own output layer (Megatron pads it further, `padded_vocab_size`)."""
        return self.shape.vocab_size

    def vocab_slice(self, vocab: int) -> tuple[int, int]:
        """This rank's output-layer shard; columns at or past `vocab` are masked by the kernels."""
        return self.vocab_start, self.vocab_stop

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's output-layer shard."""
        return self.group.tp_rank * self.shape.padded_vocab_size(self.group.tp) // self.group.tp

    @property
    def vocab_stop(self) -> int:
        """End of this rank's output-layer shard (past the vocabulary on the last TP rank: padding)."""
        return self.vocab_start + self.shape.padded_vocab_size(self.group.tp) // self.group.tp

    @property
    def head(self) -> torch.nn.Parameter:
        """[V_padded / tp, H] this rank's shard of the output layer (last stage only)."""
        if not self.group.is_last_stage:
            raise RuntimeError("only the last pipeline stage holds the output layer")
        if self.shape.tied:
            return self.model.shared_embedding_or_output_weight()
        return self.model.output_layer.weight

    @property
    def decoder_shape(self) -> tuple[int, int]:
        """(hidden size, decoder layers of this rank's pipeline stage)."""
        return self.shape.hidden_size, self.layers_per_stage

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_parameters(self) -> list[torch.Tensor]:
        """This rank's stage and slice: its parameters are its own already."""
        return list(self.parameters())

    @property
    def optimizer_shards(self) -> int:
        """The data-parallel replicas, which share the AdamW moments (`optimizer`)."""
        return self.group.dp_size

    def optimizer(self, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW over this rank's stage and slice; with data-parallel replicas, its state sharded over
        them (torch's ZeroRedundancyOptimizer: each replica steps its share of the parameters and
        broadcasts them to the others), so each holds 1/dp of the moments."""
        if self.group.dp_size == 1:
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=self.data_parallel().group,
            lr=lr,
            weight_decay=weight_decay,
        )

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def check_compatible(self, manifest: Manifest) -> None:
        """Refuses a student whose tokenizer or vocabulary differs from the store's teachers."""
        check_tokenizer(self.checkpoint, manifest)

    def save(self, folder: Path) -> None:
        """The student's config and tokenizer files (the run's first rank): what `mopd export-hf` builds
        the model from; the weights are in the checkpoint's sharded state."""
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_bytes((self.checkpoint / "config.json").read_bytes())
            save_tokenizer(self.tokenizer, folder)

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """The config and tokenizer (`model/`), and the weights and AdamW state in `state/` through
        megatron-core's `dist_checkpointing`: each tensor saved by the first data-parallel replica of the
        ranks holding it, as a slice of the whole tensor (its global shape and offset recorded), so that
        any tp × pp layout can load it. Every rank calls it."""
        from megatron.core import dist_checkpointing

        with faults.io("write", folder / MODEL_DIR):
            self.save(folder / MODEL_DIR)
        with faults.io("write", folder / SHARDED_STATE):
            state = self._sharded_state(optimizer, _whole_optimizer_state(optimizer))
            (folder / SHARDED_STATE).mkdir(parents=True, exist_ok=True)
            with megatron_device(self.group.device):
                dist_checkpointing.save(state, str(folder / SHARDED_STATE))
            release_checkpoint_writer()
        faults.point("checkpoint-shards-written")

    def load_state(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> None:
        """Loads `save_state`'s state into this rank's stage and slice (bit-exact, whatever layout saved
        it), and given an optimizer, its AdamW moments and step count (hyper-parameters: the caller's)."""
        from megatron.core import dist_checkpointing

        with megatron_device(self.group.device):
            loaded = dist_checkpointing.load(
                self._sharded_state(optimizer, None), str(folder / SHARDED_STATE)
            )
        load_state(self.model, loaded["model"])
        if optimizer is None:
            return
        moments = loaded["optimizer"]
        state = {
            i: {"step": moments["step"].clone(), **{k: moments[k][i] for k in MOMENTS}}
            for i in range(len(self.parameters()))
        }
        optimizer.load_state_dict({"state": state, "param_groups": parameter_groups(optimizer)})

    def _sharded_state(self, optimizer: torch.optim.Optimizer | None, whole: dict[str, Any] | None) -> dict:
        """megatron-core's sharded state dict of the model and, given an optimizer, of its AdamW moments
        (sharded as the parameters they belong to) and step count. `whole`: the optimizer's whole state
        on the rank that saves it; elsewhere (replicas that save nothing, or a load) placeholders of the
        parameters' shapes."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        model = self.model.sharded_state_dict()
        if optimizer is None:
            return {"model": model}
        params = self.parameters()
        sharded = get_param_id_to_sharded_param_map(model, params)
        slots = whole["state"] if whole is not None else {}
        moments: dict[str, Any] = {
            key: {
                i: make_sharded_optimizer_tensor(
                    sharded[i],
                    slots[i][key] if i in slots else torch.empty_like(p),
                    prefix=f"optimizer.{key}",
                )
                for i, p in enumerate(params)
            }
            for key in MOMENTS
        }
        step = slots[0]["step"] if 0 in slots else torch.zeros((), dtype=torch.float32)
        return {"model": model, "optimizer": {**moments, "step": step}}

    def close(self) -> None:
        """Nothing to release: the model-parallel group belongs to whoever started it (the session)."""

    def data_parallel(self) -> RankGroup:
        """The replicas of this rank's stage and slice: they sum gradients, and split the data."""
        from megatron.core import parallel_state

        return RankGroup(
            self.group.dp_rank, self.group.dp_size, group=parallel_state.get_data_parallel_group()
        )

    def finish_gradients(self) -> None:
        """Completes the gradients with megatron-core's `finalize_model_grads`: summed over the
        data-parallel replicas (the loss is normalised by the global token count already), the norms'
        weights under sequence parallelism summed over the tensor-parallel ranks (each saw its share of
        the sequence), the tied embedding's two copies (first and last stage) summed. The optimizer then
        reads them as `grad`."""
        from megatron.core.distributed import finalize_model_grads

        with megatron_device(self.group.device):
            finalize_model_grads([self.replicas])
        for p in self.parameters():
            p.grad = p.main_grad  # type: ignore[attr-defined]  # the replicas' buffer, set by megatron-core

    def grad_norm(self) -> float:
        """The global gradient norm of the whole student: tensor-parallel shards summed over their ranks,
        parameters replicated over the tensor-parallel ranks and the tied embedding's second copy
        counted once."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float64, device=self.group.device)
        for p in self.parameters():
            counted = param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False)
            if counted and p.grad is not None:
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return float(squares.sqrt())

    def clip_gradients(self, max_norm: float) -> float:
        """Scales the gradients as torch.nn.utils.clip_grad_norm_ would over the whole student; returns
        the norm before clipping."""
        norm = self.grad_norm()
        scale = min(1.0, max_norm / (norm + 1e-6))
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return norm

    def forward_backward(
        self, microbatches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list:
        """Runs the microbatches through megatron-core's pipeline schedule (forward, and backward unless
        `forward_only`) and returns, on the last stage, what `loss_fn` gave back for each (else []).

        Each microbatch needs `input_ids` [B, L] and `loss_mask` [B, L] (bool), the same on every rank of
        the group. `loss_fn` is called on the last stage only; its loss is back-propagated as it is (the
        caller normalises it: the schedule's own averaging is off).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        returned: list = []
        if not forward_only:  # the step's gradients accumulate into the replicas' zeroed buffer
            self.replicas.zero_grad_buffer()
        if not microbatches:  # a data-parallel replica with no rows in this step
            return returned
        head = self.head if self.group.is_last_stage else None

        def forward_step(data: Iterator[Any], model: Any) -> tuple[torch.Tensor, Callable]:
            mb = next(data)
            batch, length = mb.input_ids.shape
            input_ids = mb.input_ids.to(self.group.device) if self.group.is_first_stage else None
            output = stage_forward(model, input_ids, batch=batch, length=length)

            def loss_func(output_LBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                assert head is not None  # the schedule calls losses on the last stage only
                hidden_NH = output_LBH.transpose(0, 1)[mb.loss_mask.to(output_LBH.device)]
                loss_head: torch.Tensor = head
                if self.compute_dtype is not None:  # the kernel gets bf16 states and head
                    hidden_NH, loss_head = hidden_NH.to(self.compute_dtype), head.to(self.compute_dtype)
                with torch.autocast(self.group.device.type, enabled=False):  # the kernel's own policy
                    loss, extra = loss_fn(hidden_NH, loss_head, mb)
                returned.append(extra)
                return loss, torch.tensor(hidden_NH.shape[0]), {"loss": loss.detach()}

            return output, loss_func

        longest = max(mb.input_ids.shape[1] for mb in microbatches)
        autocast = (
            torch.autocast(self.group.device.type, dtype=self.compute_dtype)
            if self.compute_dtype is not None
            else nullcontext()
        )
        with megatron_device(self.group.device), autocast:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=[self.model],
                num_microbatches=len(microbatches),
                seq_length=longest,
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
                forward_only=forward_only,
            )
        return returned


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state besides its step count
DIST_CHECKPOINT = "megatron-core dist_checkpointing"


def _data_parallel(model: torch.nn.Module, device: torch.device) -> Any:
    """megatron-core's DistributedDataParallel around `model`: each parameter's gradient accumulates in
    a contiguous buffer (`main_grad`) that `finalize_model_grads` reduces over the data-parallel group
    in buckets, once a step. Without a distributed optimizer or overlapped reduction it runs on the CPU
    too (gloo)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with megatron_device(device):
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)


def _whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The optimizer's whole state dict. A ZeRO optimizer (state sharded over the data-parallel
    replicas) gathers it on the group's first rank, the one that writes, and returns None elsewhere:
    every rank of the group calls this."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if optimizer.rank == 0 else None
    return optimizer.state_dict()


def open_student(
    tc: TrainConfig, device: torch.device, world: RankGroup, exits: ExitStack
) -> MegatronStudent:
    """This rank's stage and slice of the student; the model-parallel group of `train.parallel` joins
    `exits`."""
    group = exits.enter_context(ModelParallelGroup.start(tc.parallel, device, what="train.parallel"))
    return MegatronStudent(
        tc.student,
        group=group,
        dtype=student_dtype(tc),
        mixed_precision=tc.mixed_precision == "bf16",
        activation_checkpointing=tc.activation_checkpointing,
    )


def export_whole(checkpoint: Path, dtype: str, folder: Path) -> None:
    """The whole student from megatron-core's distributed checkpoint, loaded into a one-rank GPTModel
    (tp = pp = 1, megatron-core re-cutting the slices) whose weights mopd's conversion
    (`mopd.mcore.convert.megatron_to_hf`, bit-exact, vocabulary padding dropped) turns into the student's
    own architecture."""
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from mopd.config.parallel import ParallelConfig
    from mopd.mcore.convert import GPTShape, megatron_to_hf
    from mopd.mcore.cpu_compat import install_cpu_rng_tracker
    from mopd.mcore.model import gpt_model

    shape = GPTShape.from_hf_config(AutoConfig.from_pretrained(checkpoint / MODEL_DIR))
    cpu = torch.device("cpu")
    with (
        _world_of_one(),
        ModelParallelGroup.start(ParallelConfig(), cpu, what="export-hf"),
        megatron_device(cpu),
    ):
        install_cpu_rng_tracker()
        model = gpt_model(shape, tp=1, pp=1, dtype=getattr(torch, dtype), pre_process=True, post_process=True)
        sharded = {"model": model.sharded_state_dict()}
        load_state(model, dist_checkpointing.load(sharded, str(checkpoint / SHARDED_STATE))["model"])
        weights = {
            k: v
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")
        }
    _save_converted(
        megatron_to_hf([[weights]], shape, layers_per_stage=[shape.num_layers]),
        checkpoint / MODEL_DIR,
        folder,
    )


@contextmanager
def _world_of_one() -> Iterator[None]:
    """A process group of this process alone (also inside torchrun's environment: the export runs on
    one rank, after the run's own group is gone), unless one is already up."""
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


BACKEND = Backend(open_student=open_student, export_whole=export_whole)
