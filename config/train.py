"""What `mopd train` reads: the student, the divergence, the optimiser, batches, evaluation, checkpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from mopd.base.section import Device, NonEmpty, Section
from mopd.config.parallel import StudentParallelConfig

# The divergences the fused kernel computes (train/kernel/divergence.py takes its list from here).
DivergenceKind = Literal["reverse_kl", "forward_kl", "jsd", "cross_entropy", "entropy", "tvd"]


class DivergenceConfig(Section):
    kind: DivergenceKind = "reverse_kl"
    beta: float = Field(0.5, ge=0.0, le=1.0)
    temperature: float = Field(1.0, gt=0.0)
    # Tokens per kernel chunk; "auto": the measured default of the device (train/kernel/divergence.py).
    chunk_size: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    ce_weight: float = Field(0.0, ge=0.0)
    # The chunk chain compiled with torch.compile: "auto" on CUDA only; a failure to compile falls
    # back to eager with one log line.
    compile: Literal["auto", "on", "off"] = "auto"
    # "token": mean over the step's trained tokens; "sequence": mean per row, then over the step's rows.
    level: Literal["token", "sequence"] = "token"

    @model_validator(mode="after")
    def _jsd_is_not_degenerate(self) -> DivergenceConfig:
        # mopd's JSD(β) mixes m = β·p_t + (1−β)·p_s: at β = 0 or 1, m is one of the two distributions and
        # the divergence is 0 with zero gradient. Other tools' β = 1 means reverse KL; say so, never
        # train on a silent zero.
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            instead = "reverse_kl" if self.beta == 1.0 else "forward_kl"
            raise ValueError(
                f"kind jsd with beta {self.beta} is identically 0 (nothing would train); for what other "
                f"tools call JSD at beta {self.beta:g}, use kind: {instead}"
            )
        return self


class OptimConfig(Section):
    lr: float = Field(1.0e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)


class BatchConfig(Section):
    micro_batch_tokens: int = Field(8192, gt=0)
    global_batch_tokens: int = Field(65536, gt=0)


class EvalConfig(Section):
    # Rows held out of training (a seeded choice) and evaluated every `every` steps (0: start and end).
    rows: int = Field(0, ge=0)
    every: int = Field(0, ge=0)


class CheckpointConfig(Section):
    every: int = Field(100, gt=0)
    keep: int = Field(3, ge=1)


class InitFromConfig(Section):
    """A new run that starts from a training checkpoint's student (and optionally its optimizer state)."""

    checkpoint: NonEmpty
    optimizer: bool = False


class CrossTokenizerConfig(Section):
    """Teachers of other tokenizers than the student's (DESIGN §13)."""

    # alias → a projection file (safetensors: int64 source, target, float32 weight; metadata
    # teacher_vocab, student_vocab) that replaces the store's first-token projection of that teacher.
    projection: dict[str, NonEmpty] = Field(default_factory=dict)
    # The span log-likelihood match's weight beside the divergence at aligned positions: each span of
    # the same bytes that is more than one token on either side counts as one trained token of
    # ½ (ℓ_student − ℓ_teacher)² (train/kernel/spans.py). 0 turns it off.
    span_weight: float = Field(1.0, ge=0.0)


class EnsembleConfig(Section):
    """How the teachers of a row routed to several combine at each token (DESIGN §14, docs/ensembles.md),
    each weighted by its `train.teacher_weights`: `mixture` distils Σ_k w_k p_k; `sum` is Σ_k w_k D(p_k,
    q); `min_ce` takes the teacher most likely to emit the row's next token; `confidence` mixes with
    weights w_k · (each teacher's probability of its own top token)."""

    method: Literal["mixture", "sum", "min_ce", "confidence"] = "mixture"


class TrainConfig(Section):
    student: NonEmpty
    # Start this (new) run from another run's checkpoint: its weights, and with optimizer: true its
    # AdamW moments; the data order, schedule and step count start afresh. Never a resume.
    init_from: InitFromConfig | None = None
    # hf: a transformers student replicated on every rank; fsdp: the same student sharded with FSDP2
    # (parameters, gradients and AdamW state split over the ranks); megatron: a megatron-core student.
    backend: Literal["hf", "fsdp", "megatron"] = "hf"
    parallel: StudentParallelConfig = StudentParallelConfig()
    divergence: DivergenceConfig = DivergenceConfig()
    teacher_weights: dict[str, float] = Field(default_factory=dict)
    ensemble: EnsembleConfig = EnsembleConfig()
    cross_tokenizer: CrossTokenizerConfig = CrossTokenizerConfig()
    lm_head_lifecycle: Literal["none", "offload", "evict"] = "offload"
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    steps: int = Field(1000, gt=0)
    seed: int = Field(0, ge=0, lt=2**63)  # what torch.manual_seed and numpy's generators take
    device: Device = "auto"
    # Student parameter dtype (AdamW state follows it). bfloat16 keeps weights and AdamW state in bf16,
    # where most distillation-sized updates round away (the trainer warns with the figure); for bf16
    # compute over fp32 weights use mixed_precision: bf16.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # bf16: fp32 master weights and AdamW state, bf16 forward and backward, fp32 gradient reduction.
    mixed_precision: Literal["none", "bf16"] = "none"
    # Recompute each decoder block's activations in the backward instead of keeping them.
    activation_checkpointing: bool = False
    # The vocabulary distilled over; default the tokenizer's length as the store records it (see
    # train/vocabulary.py). Set it only when the tokenizer's added tokens sit past the models' rows.
    vocab_size: int | None = Field(None, gt=0)
    eval: EvalConfig = EvalConfig()
    # Steps the loader reads ahead of training, in a background thread (their rows stay in memory).
    prefetch: int = Field(2, ge=1)
    output_dir: NonEmpty = "out/run"
    checkpoint: CheckpointConfig = CheckpointConfig()
    # Experiment trackers fed the records of metrics.jsonl, rank 0 only (train/report/tracking.py); the
    # packages come with `pip install 'mopd[tracking]'`.
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_is_a_list(cls, value: Any) -> Any:
        """`report_to: tensorboard` (and `train.report_to=tensorboard` typed) is the list of that one."""
        return [value] if isinstance(value, str) else value

    @field_validator("parallel")
    @classmethod
    def _hf_is_data_parallel_only(
        cls, parallel: StudentParallelConfig, info: ValidationInfo
    ) -> StudentParallelConfig:
        backend = info.data.get("backend")
        if backend in ("hf", "fsdp") and (parallel.tp > 1 or parallel.pp > 1):
            raise ValueError(
                f"the {backend} backend trains with data parallelism only (tp = pp = 1); tensor and "
                "pipeline parallelism need train.backend megatron"
            )
        if backend != "fsdp" and "gradient_sync" in parallel.model_fields_set:
            raise ValueError(
                f"gradient_sync is for train.backend fsdp; the {backend} backend sums the gradients once "
                "a step"
            )
        if backend != "fsdp" and parallel.dp_replicate > 1:
            raise ValueError(
                "dp_replicate (sharding within groups of ranks, replicating across them) is for "
                f"train.backend fsdp; the {backend} backend does not shard the student over data parallelism"
            )
        return parallel

    @model_validator(mode="after")
    def _one_precision(self) -> TrainConfig:
        if self.dtype == "bfloat16" and self.mixed_precision == "bf16":
            raise ValueError(
                "dtype bfloat16 with mixed_precision bf16: mixed precision keeps fp32 master weights; "
                "set dtype: float32 (the default) with mixed_precision: bf16"
            )
        if self.mixed_precision == "bf16" and self.parallel.sequence_parallel:
            # megatron-core's sequence-parallel linear layers allocate their gradient buffers in the
            # input's dtype (fp32 under autocast) and reduce-scatter bf16 gradients into them.
            raise ValueError(
                "mixed_precision bf16 with parallel.sequence_parallel: megatron-core's sequence-parallel "
                "layers need one dtype for activations and gradients, which autocast's bf16 products over "
                "fp32 weights do not give; turn sequence_parallel off (tensor parallelism still splits "
                "the layers) or mixed_precision off"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _init_from_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("init_from"), str):
            return {**data, "init_from": {"checkpoint": data["init_from"]}}
        return data
