"""The `hf` student: a transformers causal LM whose own output layer is bypassed.

`hidden_states` runs the backbone only (everything up to and including the final norm); the loss takes
those states and the output layer's weight (`head`) and calls the fused kernels, so the student's
[tokens × vocab] logits are never formed. Tied embeddings work unchanged: `head` is then the embedding
matrix, and its gradient gathers both uses.

On several ranks each holds the whole student, wrapped in torch's DistributedDataParallel: the
backward of a step's last microbatch sums every gradient over the ranks (in buckets, overlapping the
rest of that backward); the earlier microbatches accumulate locally (`no_sync`). The trainer normalises
the loss by the global batch, so the reduction sums, never averages. Every rank runs as many
microbatches as the rank with the most: the others run a one-token filler whose loss is 0 × (its
outputs), which adds exact zeros to every gradient.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from mopd.base import faults
from mopd.base.errors import ConfigError
from mopd.config.train import TrainConfig
from mopd.store.format.fingerprint import vocab_hash
from mopd.store.format.manifest import Manifest
from mopd.store.format.transform import LogitTransform
from mopd.tokens.pieces import swapped_tokenizer
from mopd.train.backends.groups import RankGroup, sum_over_ranks
from mopd.train.backends.protocol import (
    MODEL_DIR,
    OPTIMIZER_FILE,
    Backend,
    LossFn,
    StudentLayout,
    student_dtype,
)

STUDENT_TOKENIZER_FIX = "precompute the store again with this student (its `tokenizer:`)"
# Any of these means the checkpoint carries a tokenizer (a bare weights folder has none of them).
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "vocab.json")


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers without its per-file progress bars (the trainer prints its own lines)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def check_tokenizer(checkpoint: Path, manifest: Manifest) -> None:
    """Refuses a student whose tokenizer differs from the store's teachers' (whether its output rows
    cover the vocabulary, `vocabulary.distilled_vocabulary` checks)."""
    tokenizer_file = checkpoint / "tokenizer.json"
    if tokenizer_file.exists() and vocab_hash(checkpoint) != manifest.tokenizer.vocab_hash:
        raise ConfigError(
            f"train.student: {checkpoint} has another tokenizer vocabulary than the store "
            f"({manifest.tokenizer.name}); the store's rows are in that vocabulary: precompute a store "
            "with the student's (set `tokenizer:` to it)"
        )
    # A store with teachers of other tokenizers was aligned to one tokenizer, bound by its fingerprint:
    # the same vocabulary tokenising otherwise (another normaliser, chat template) would misalign.
    if manifest.tokenizer.fingerprint:
        problem = swapped_tokenizer(
            checkpoint, manifest.tokenizer.fingerprint, what="train.student", fix=STUDENT_TOKENIZER_FIX
        )
        if problem:
            raise ConfigError(problem)


def load_student_tokenizer(checkpoint: Path) -> Any:
    """The tokenizer a student checkpoint carries (None when it carries none), to be saved beside every
    checkpoint of it with `save_tokenizer`."""
    if not any((checkpoint / name).exists() for name in TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    with _quiet():
        return AutoTokenizer.from_pretrained(checkpoint)


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """`tokenizer` next to a checkpoint's weights, saved by transformers itself so that every file it
    needs comes along (vocabulary, settings, special tokens, the chat template in whatever file this
    transformers keeps it): an exported student is prompted exactly as the original one."""
    if tokenizer is not None:
        with _quiet():
            tokenizer.save_pretrained(folder)


class HFStudent:
    """A transformers causal LM loaded from a local checkpoint folder, in `dtype`, on `device`; its
    data-parallel replicas are the ranks of `dp`.

    Every rank holds the whole model, computes the loss and reports its statistics.
    """

    holds_loss = True  # this rank runs the loss (and so needs the teacher heads)
    reports = True  # this rank's per-token statistics count toward the step's metrics
    optimizer_shards = 1  # every replica holds the whole AdamW state
    tp_group = None

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        dp: RankGroup,
        mixed_precision: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.dp = dp
        self.device = device
        # bf16 compute over fp32 weights (torch.autocast); the loss gets bf16 states and head.
        self.compute_dtype = torch.bfloat16 if mixed_precision else None
        self.checkpoint = Path(checkpoint)
        if not self.checkpoint.is_dir():
            raise ConfigError(f"train.student: {self.checkpoint} is not a checkpoint folder")
        try:
            with _quiet():  # safetensors only: a pickled checkpoint could run code when loaded
                self.model = AutoModelForCausalLM.from_pretrained(
                    self.checkpoint, dtype=dtype, use_safetensors=True
                )
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"train.student: {self.checkpoint} cannot be loaded ({' '.join(str(err).split())}); mopd "
                "loads safetensors weights only (save the student with save_pretrained)"
            ) from err
        torch.nn.Module.to(self.model, device)
        self.model.train()
        transform = LogitTransform.from_model_config(self.model.config)
        if not transform.is_identity:
            raise ConfigError(
                f"train.student: {self.checkpoint} post-processes its logits ({transform}); mopd trains "
                "students whose logits are hidden · headᵀ"
            )
        output = self.model.get_output_embeddings()
        if output is None or getattr(output, "bias", None) is not None:
            raise ConfigError(f"train.student: {self.checkpoint} has no bias-free linear output layer")
        self.tokenizer = load_student_tokenizer(self.checkpoint)
        if activation_checkpointing:  # each decoder block recomputes its activations in the backward
            self.model.config.use_cache = False  # no generation cache while training (they conflict)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.trunk: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.replicate(
            FinalStates(self.model)
        )

    def replicate(self, trunk: FinalStates) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`trunk` as the data-parallel ranks run it: wrapped in DistributedDataParallel, summing."""
        if not self.dp.enabled:
            return trunk
        from torch.nn.parallel import DistributedDataParallel

        replicated = DistributedDataParallel(
            trunk,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            process_group=self.dp.group,
            broadcast_buffers=False,  # rotary tables only: the same on every rank, never trained
        )
        replicated.register_comm_hook(self.dp.group, sum_over_ranks)
        return replicated

    @property
    def head(self) -> torch.nn.Parameter:
        """[V, H] the output layer's weight (the embedding matrix when tied)."""
        return self.model.get_output_embeddings().weight

    @property
    def decoder_shape(self) -> tuple[int, int]:
        """(hidden size, decoder layers): every layer is on every rank."""
        config = self.model.config
        return int(config.hidden_size), int(config.num_hidden_layers)

    @property
    def output_rows(self) -> int:
        """Rows of the output layer (the tokenizer's tokens and any padding past them)."""
        return int(self.head.shape[0])

    def vocab_slice(self, vocab: int) -> tuple[int, int]:
        """The rows the loss uses: the distilled vocabulary's (padding rows take no part)."""
        return 0, vocab

    @property
    def layout(self) -> StudentLayout:
        """What a checkpoint of this student must match to be resumed by it."""
        return StudentLayout(backend="hf")

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_parameters(self) -> list[torch.Tensor]:
        """Each parameter as this rank holds it: whole, on every replica."""
        return list(self.parameters())

    def optimizer(self, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW over this rank's parameters (the whole student, or under fsdp this rank's shards)."""
        return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)

    def data_parallel(self) -> RankGroup:
        return self.dp

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def forward_backward(
        self, microbatches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list:
        """Forward (and, unless `forward_only`, backward) of each microbatch in turn, then fillers up to
        the count the replicas agree on (`microbatch_count`); returns what `loss_fn` gave back for each
        real microbatch. Microbatches need `input_ids`, `attention_mask` and `loss_mask`."""
        count = self.microbatch_count(len(microbatches), forward_only=forward_only)
        returned = []
        with torch.no_grad() if forward_only else nullcontext():
            for i in range(count):
                with self.gradient_sync(forward_only or i == count - 1):
                    if i < len(microbatches):
                        mb = microbatches[i]
                        hidden = self.hidden_states(mb.input_ids, mb.attention_mask)
                        loss, extra = loss_fn(hidden[mb.loss_mask.to(self.device)], self.loss_head(), mb)
                        returned.append(extra)
                    else:
                        one = torch.ones((1, 1), dtype=torch.long)
                        hidden = self.hidden_states(one, one)
                        loss = 0.0 * (hidden.float().sum() + self.loss_head().float().sum())
                    if not forward_only:
                        loss.backward()
        self.after_microbatches()
        return returned

    def microbatch_count(self, held: int, *, forward_only: bool) -> int:
        """Microbatches this rank runs: the most any replica holds where the replicas reduce gradients
        in the backward (each reduction needs every rank), else the `held` ones."""
        if forward_only or not self.dp.enabled:
            return held
        return int(self.dp.all_reduce(torch.tensor([held]), op=torch.distributed.ReduceOp.MAX)[0])

    def gradient_sync(self, sync: bool) -> Any:
        """Around one microbatch: its backward reduces the gradients over the replicas only if `sync`
        (the step's last one); before that they accumulate on each rank."""
        no_sync = getattr(self.trunk, "no_sync", None)
        return nullcontext() if sync or no_sync is None else no_sync()

    def loss_head(self) -> torch.Tensor:
        """The output layer as the loss takes it (in the compute dtype under mixed precision)."""
        return self.head if self.compute_dtype is None else self.head.to(self.compute_dtype)

    def after_microbatches(self) -> None:
        """Nothing to release after a step's microbatches."""

    def finish_gradients(self) -> None:
        """Nothing: the backward of the step's last microbatch summed the gradients over the replicas."""

    def clip_gradients(self, max_norm: float) -> float:
        """Clips the global gradient norm to `max_norm`; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm))

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, H] final hidden states (after the last norm), the output layer's input."""
        with self.autocast():
            hidden = self.trunk(input_ids.to(self.device), attention_mask.to(self.device))
        return hidden if self.compute_dtype is None else hidden.to(self.compute_dtype)

    def autocast(self) -> Any:
        """bf16 compute under `mixed_precision` (weights stay fp32), else nothing."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def check_compatible(self, manifest: Manifest) -> None:
        """Refuses a student whose tokenizer differs from the store's teachers'."""
        check_tokenizer(self.checkpoint, manifest)

    def save(self, folder: Path) -> None:
        """A complete transformers checkpoint (config, safetensors weights, tokenizer files)."""
        with _quiet():
            self.model.save_pretrained(folder)
        save_tokenizer(self.tokenizer, folder)

    def close(self) -> None:
        """Nothing to release (the trainer owns the data-parallel group)."""

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """The whole student (`model/`, a transformers checkpoint) and its AdamW state, written by the
        first replica (the replicas are identical). Every rank calls it."""
        if self.dp.rank != 0:
            return
        with faults.io("write", folder / MODEL_DIR):
            self.save(folder / MODEL_DIR)
        with faults.io("write", folder / OPTIMIZER_FILE):
            save_optimizer_file(folder / OPTIMIZER_FILE, optimizer)

    def load_state(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> None:
        """`save_state`'s weights and, given an optimizer, its AdamW moments and step counts (the
        hyper-parameters are the caller's to set)."""
        self.load_weights(folder / MODEL_DIR)
        if optimizer is not None:
            load_optimizer_file(folder / OPTIMIZER_FILE, optimizer)

    def load_weights(self, folder: Path) -> None:
        """Loads weights saved by `save` (bit-exact; resuming continues from exactly these values)."""
        from safetensors.torch import load_file

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{folder} holds no safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {name for name in missing if name.endswith("lm_head.weight")}
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"{folder}: weights do not fit the student (missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})"
            )
        if tied:
            self.model.tie_weights()


class FinalStates(torch.nn.Module):
    """The backbone's output (after the final norm) as a module's forward, over the whole model: what
    a data-parallel wrapper wraps (the output layer's gradient comes from the loss, outside it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return final_states(self.model, input_ids, attention_mask)


def final_states(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L, H] a transformers causal LM's backbone output, the input of its output layer."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def save_optimizer_file(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's per-parameter state as one safetensors file, keyed "<param position>.<name>"."""
    from safetensors.torch import save_file

    tensors = {
        f"{position}.{name}": value.detach().contiguous().cpu()
        for position, slots in optimizer.state_dict()["state"].items()
        for name, value in slots.items()
    }
    save_file(tensors, str(path))


def load_optimizer_file(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """`save_optimizer_file`'s state into `optimizer` (its own parameter groups kept)."""
    from safetensors.torch import load_file

    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path)).items():
        position, name = key.split(".", 1)
        slots.setdefault(int(position), {})[name] = value
    optimizer.load_state_dict({"state": slots, "param_groups": optimizer.state_dict()["param_groups"]})


def open_student(tc: TrainConfig, device: torch.device, world: RankGroup, exits: ExitStack) -> HFStudent:
    """The whole student on this rank, its data-parallel replicas the ranks of `world`."""
    return HFStudent(
        tc.student,
        device=device,
        dtype=student_dtype(tc),
        dp=world,
        mixed_precision=tc.mixed_precision == "bf16",
        activation_checkpointing=tc.activation_checkpointing,
    )


def export_whole(checkpoint: Path, dtype: str, folder: Path) -> None:
    """The checkpoint's `model/` is a transformers checkpoint already: copied."""
    shutil.copytree(checkpoint / MODEL_DIR, folder, dirs_exist_ok=True)


BACKEND = Backend(open_student=open_student, export_whole=export_whole)
