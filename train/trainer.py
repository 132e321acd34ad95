"""`mopd train`: distil the student from the store (DESIGN §7).

One optimiser step: this replica's microbatches of the step run forward and backward (one at a time on
the hf backend, through megatron-core's pipeline schedule on the megatron backend), each token's loss
weighted by 1 / (the step's trained tokens over all data-parallel replicas) — or, at sequence level, by
1 / (its row's trained tokens × the step's trained rows over all replicas) — so the gradients summed over
the replicas are those of the global batch whatever the layout. Then the gradient norm is checked and
clipped, and AdamW steps under a linear-warmup, cosine-decay schedule.

Ranks: the world is torchrun's processes. On the hf backend each is a data-parallel replica holding the
whole student. On the megatron backend the world splits into tp × pp model-parallel groups, one per
replica; only the last pipeline stage holds teacher heads (its TP rank's vocabulary slice) and computes
the loss, and its first TP rank reports the per-token statistics that rank 0 logs.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mopd.base.devices import rank_device
from mopd.base.errors import CheckpointError, ConfigError, ManifestError, MopdError
from mopd.config.mopd_config import MopdConfig
from mopd.config.train import TrainConfig
from mopd.store.manifest import Manifest
from mopd.store.reader import TeacherStore, open_store
from mopd.store.teachers import TeacherIdentity, diff_teacher_lists, read_teacher_list
from mopd.train.checkpoint import (
    ResumePoint,
    check_checkpoint_files,
    check_layout,
    complete_checkpoints,
    load_checkpoint,
    load_weights,
    read_state,
    remove_temporaries,
    save_checkpoint,
)
from mopd.train.data_order import LoaderState, rank_microbatches
from mopd.train.distributed import RankGroup
from mopd.train.heads import TeacherHeads
from mopd.train.loader import MicroBatch, Step, StoreLoader, read_microbatches
from mopd.train.metrics import (
    PLOT_FILE,
    EvalRecord,
    MetricsLog,
    Record,
    StepClock,
    StepOutcome,
    TrainRecord,
    eval_line,
    plot_metrics,
    step_line,
)
from mopd.train.objective import Objective, StepStats, teacher_weights
from mopd.train.run_record import diff_run_records, run_record
from mopd.train.student import HFStudent, LossFn, TrainStudent
from mopd.train.vocabulary import distilled_vocabulary

Log = Callable[[str], None]


class NonFiniteError(MopdError):
    """A loss or gradient was NaN or infinite; the step was not applied."""


@dataclass
class TrainResult:
    output: Path
    first_step: int  # the first step this run trained (resumed runs start after their checkpoint)
    last_step: int
    checkpoint: Path | None
    heads_peak_resident: int
    heads_by_rank: list[int]  # bytes of teacher heads each rank of the world held
    records: list[Record] = field(default_factory=list)  # this run's metrics records, train and eval
    reports: bool = True  # rank 0 of the world: the one that logs, writes metrics and may export


def held_out_rows(num_rows: int, count: int, seed: int) -> np.ndarray:
    """The rows evaluated instead of trained: a seeded choice, a pure function of (rows, count, seed)."""
    if count >= num_rows:
        raise ConfigError(f"train.eval.rows: {count} held-out rows leave none of the {num_rows} to train")
    return np.sort(np.random.default_rng([seed, 1 << 20]).choice(num_rows, size=count, replace=False))


def lr_factor(step: int, *, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total` (`step` counts from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Trainer:
    """A training run: the store, the student, the heads, the optimiser and the data order."""

    def __init__(
        self,
        config: MopdConfig,
        *,
        store_path: str | Path | None = None,
        output: str | Path | None = None,
        log: Log = print,
    ) -> None:
        if config.train is None:
            raise ConfigError("the config has no `train` section; add one (see DESIGN §9) to train")
        tc: TrainConfig = config.train
        if tc.backend == "hf" and (tc.parallel.tp > 1 or tc.parallel.pp > 1):
            raise ConfigError(
                "train.parallel: the hf backend trains with data parallelism only (tp = pp = 1); tensor and "
                "pipeline parallelism need train.backend megatron"
            )
        self.tc = tc
        self.device = rank_device(tc.device)
        self.world = RankGroup.from_environment(self.device)  # every process of the run
        self.log = log if self.world.rank == 0 else (lambda _line: None)
        self.output = Path(output or tc.output_dir)
        torch.manual_seed(tc.seed)
        self.store: TeacherStore = open_store(store_path or config.store.path)
        manifest = self.store.manifest
        self.log(
            f"store {self.store.root}: {self.store.num_rows:,} rows, {manifest.dataset.num_tokens:,} tokens, "
            f"{len(manifest.teachers)} teachers"
        )
        if self.store.format_note:
            self.log(f"note: {self.store.format_note}")
        self.log(f"loading student {tc.student} ({tc.backend}, {tc.dtype}) on {self.device}")
        self.student = self._load_student(tc)
        try:
            self._prepare(tc, manifest)
        except BaseException:
            self.student.close()  # a megatron student leaves its parallel state
            raise

    def _prepare(self, tc: TrainConfig, manifest: Manifest) -> None:
        """Everything after the student: heads, objective, loader, optimiser."""
        # The student's data-parallel replicas: the world on the hf backend, one rank of each
        # model-parallel group on the megatron backend. The loader deals rows to them.
        self.replicas = self.student.data_parallel()
        self.student.check_compatible(manifest)
        self.vocab_size = distilled_vocabulary(
            manifest, student_rows=self.student.output_rows, override=tc.vocab_size
        )
        vocab_start, vocab_stop = self.student.vocab_slice(self.vocab_size)
        self.num_teachers = max(t.index for t in manifest.teachers) + 1
        self.heads = TeacherHeads(
            self.store,
            [t.index for t in manifest.teachers] if self.student.holds_loss else [],
            lifecycle=tc.lm_head_lifecycle,
            device=self.device,
            vocab_start=vocab_start,
            vocab_stop=vocab_stop,
        )
        self.heads_by_rank = self._account_heads()
        self.objective = Objective(
            tc.divergence,
            self.heads,
            teacher_weights(manifest, tc.teacher_weights),
            self.vocab_size,
            self.student,
            vocab_slice=(vocab_start, vocab_stop),
        )
        held = held_out_rows(self.store.num_rows, tc.eval.rows, tc.seed) if tc.eval.rows else np.zeros(0, int)
        self.eval_rows = held
        self.loader = StoreLoader(
            self.store,
            np.setdiff1d(np.arange(self.store.num_rows), held),
            micro_batch_tokens=tc.batch.micro_batch_tokens,
            global_batch_tokens=tc.batch.global_batch_tokens,
            dp_rank=self.replicas.rank,
            dp_size=self.replicas.size,
            prefetch=tc.prefetch,
            teacher_hidden=self.student.holds_loss,
        )
        self.optimizer = torch.optim.AdamW(
            self.student.parameters(), lr=tc.optim.lr, weight_decay=tc.optim.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=tc.optim.warmup_steps, total=tc.steps)
        )
        self.teacher_list = [TeacherIdentity(t.index, t.checkpoint, t.fingerprint) for t in manifest.teachers]
        self.run_record = run_record(tc, manifest, data_parallel_size=self.replicas.size)

    def _load_student(self, tc: TrainConfig) -> TrainStudent:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[tc.dtype]
        if tc.backend == "megatron":
            from mopd.mcore.parallel import ModelParallelGroup
            from mopd.train.megatron_student import MegatronStudent

            group = ModelParallelGroup.start(tc.parallel, self.device, what="train.parallel")
            try:
                return MegatronStudent(tc.student, group=group, dtype=dtype)
            except BaseException:
                group.close()
                raise
        return HFStudent(tc.student, device=self.device, dtype=dtype, dp=self.world)

    def _account_heads(self) -> list[int]:
        """Bytes of teacher heads each rank of the world holds (device or host), logged by rank 0."""
        held = self.world.all_gather_object(self.heads.held_bytes)
        if self.tc.lm_head_lifecycle == "none":
            self.log(
                f"lm_head_lifecycle none: {len(self.heads.teachers)} teacher heads stay on {self.device} "
                f"({self.heads.resident_bytes / 2**20:.1f} MiB); this grows linearly with the teacher count"
            )
        if self.world.enabled:
            self.log(
                "teacher heads held by rank: "
                + ", ".join(f"{rank}: {size / 2**20:.2f} MiB" for rank, size in enumerate(held))
            )
        return held

    @property
    def checkpoint_root(self) -> Path:
        return self.output / "checkpoints"

    def _resume_point(self, resume: bool | None) -> ResumePoint | None:
        if self.world.rank == 0:
            stale = remove_temporaries(self.checkpoint_root)
            if stale:
                self.log(f"removed {len(stale)} unfinished checkpoint save(s): {', '.join(stale)}")
        self.world.barrier()
        found = complete_checkpoints(self.checkpoint_root)
        if not found:
            return None
        latest = found[-1]
        if resume is False:
            raise ConfigError(
                f"{self.output} already holds checkpoints (latest {latest.name}); pass --resume to continue "
                "that run, or choose another --output"
            )
        self._check_files(latest)
        problems = diff_teacher_lists(self.teacher_list, read_teacher_list(latest))
        if problems:
            raise ManifestError(
                f"cannot resume from {latest}: its teacher list differs from the store {self.store.root}:\n  "
                + "\n  ".join(problems)
            )
        state = read_state(latest)
        check_layout(latest, state, self.student, doing="resume from")
        changed = diff_run_records(state.get("run", {}), self.run_record)
        if changed:
            raise CheckpointError(
                f"cannot resume from {latest}: it was trained on another store or with other settings:\n  "
                + "\n  ".join(changed)
                + "\nrestore them, or start a new run from that checkpoint with `train.init_from`"
            )
        point = load_checkpoint(
            latest, student=self.student, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.log(f"resuming from {latest} (step {point.step})")
        return point

    def _check_files(self, folder: Path) -> None:
        """Rank 0 hashes the checkpoint's files against its marker; every rank raises what it found."""
        problem = None
        if self.world.rank == 0:
            try:
                check_checkpoint_files(folder)
            except CheckpointError as err:
                problem = str(err)
        problem = self.world.broadcast_object(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def start_from(self) -> None:
        """A new run that starts from `train.init_from`'s weights (and optionally optimizer state)."""
        init = self.tc.init_from
        if init is None:
            return
        folder = Path(init.checkpoint)
        if not (folder / "state.json").exists():
            found = complete_checkpoints(folder / "checkpoints") or complete_checkpoints(folder)
            if not found:
                raise ConfigError(f"train.init_from: {folder} is neither a checkpoint nor a run folder")
            folder = found[-1]
        self._check_files(folder)
        check_layout(folder, read_state(folder), self.student, doing="start from")
        load_weights(folder, self.student, self.optimizer if init.optimizer else None, hyper_parameters=False)
        state = "weights and optimizer state" if init.optimizer else "weights"
        self.log(f"new run starting from the {state} of {folder}")

    def _token_norm(self, mb: MicroBatch, denominator: float) -> torch.Tensor:
        if self.tc.divergence.level == "token":
            return torch.full((mb.num_trained,), 1.0 / denominator, device=self.device)
        per_row = mb.loss_mask.sum(1).to(torch.float32)
        return 1.0 / (per_row[mb.token_row] * denominator)

    def _global_denominator(self, microbatches: list[MicroBatch]) -> tuple[float, float]:
        """(normaliser of the loss, all tokens of the step), both summed over the replicas."""
        trained = sum(mb.num_trained for mb in microbatches)
        rows = sum(int(mb.loss_mask.any(1).sum()) for mb in microbatches)
        tokens = sum(mb.num_tokens for mb in microbatches)
        counts = self.replicas.all_reduce(torch.tensor([trained, rows, tokens], dtype=torch.float64))
        denominator = counts[0] if self.tc.divergence.level == "token" else counts[1]
        return max(float(denominator), 1.0), float(counts[2])

    def _loss_fn(
        self, stats: StepStats, norm_of: Callable[[MicroBatch], torch.Tensor], *, train: bool
    ) -> LossFn:
        """The loss of one microbatch as the student's forward_backward calls it, its per-token
        divergences gathered into `stats`; `norm_of` gives each trained token's weight."""

        def loss_fn(hidden: torch.Tensor, head: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, None]:
            mb = mb.to(self.device)
            loss, per_token = self.objective(hidden, head if train else head.detach(), mb, norm_of(mb))
            if self.student.reports:
                stats.add(per_token, mb.teacher_index, loss if train else torch.zeros(()))
            return loss, None

        return loss_fn

    def train_step(self, step: int, batch: Step) -> StepOutcome:
        """Forward and backward of this replica's microbatches, gradient sum over the replicas, optimiser
        step."""
        self.optimizer.zero_grad(set_to_none=True)
        denominator, tokens = self._global_denominator(batch.microbatches)
        stats = StepStats(self.num_teachers)
        norm_of = lambda mb: self._token_norm(mb, denominator)  # noqa: E731
        self.student.forward_backward(batch.microbatches, self._loss_fn(stats, norm_of, train=True))
        self.student.finish_gradients()
        stats.reduce(self.world)
        grad_norm = self.student.clip_gradients(self.tc.optim.grad_clip)
        if stats.nonfinite.any() or not math.isfinite(grad_norm) or not math.isfinite(float(stats.loss)):
            self._refuse_nonfinite(step, stats, grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return StepOutcome(
            step=step,
            loss=float(stats.loss),
            **stats.divergences(),
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(tokens),
            memory_gib=_memory_gib(self.device),
        )

    def _refuse_nonfinite(self, step: int, stats: StepStats, grad_norm: float) -> None:
        flags = torch.zeros(self.world.size, dtype=torch.float64)
        flags[self.world.rank] = stats.local_nonfinite
        ranks = self.world.all_reduce(flags).nonzero()[:, 0].tolist()
        teachers = stats.nonfinite.nonzero()[:, 0].tolist()
        where = (
            f"non-finite divergence on rank {', '.join(map(str, ranks))} for teacher "
            f"{', '.join(map(str, teachers))}"
            if teachers
            else f"non-finite gradient (norm {grad_norm}) on rank {self.world.rank}"
        )
        latest = complete_checkpoints(self.checkpoint_root)
        kept = (
            f"the last complete checkpoint {latest[-1]} is untouched"
            if latest
            else "no checkpoint was written"
        )
        raise NonFiniteError(
            f"step {step}: {where}; the step was not applied and {kept}. Lower train.optim.lr or check the "
            "store with `mopd verify-manifest --full`"
        )

    @torch.no_grad()
    def evaluate(self, step: int) -> EvalRecord:
        """Mean divergence per trained token of the held-out rows, by teacher (no weighting, no CE)."""
        self.student.train(False)
        stats = StepStats(self.num_teachers)
        microbatches = read_microbatches(
            self.store,
            rank_microbatches(
                self.eval_rows,
                self.store.lengths,
                dp_rank=self.replicas.rank,
                dp_size=self.replicas.size,
                micro_batch_tokens=self.tc.batch.micro_batch_tokens,
            ),
            teacher_hidden=self.student.holds_loss,
        )
        zero = lambda mb: torch.zeros(mb.num_trained, device=self.device)  # noqa: E731
        self.student.forward_backward(
            microbatches, self._loss_fn(stats, zero, train=False), forward_only=True
        )
        stats.reduce(self.world)
        self.student.train()
        return EvalRecord(split="eval", step=step, **stats.divergences())

    def _should_eval(self, step: int, last: int) -> bool:
        every = self.tc.eval.every
        return self.eval_rows.shape[0] > 0 and (step == last or (every > 0 and step % every == 0))

    def run(self, *, resume: bool | None = None, max_steps: int | None = None) -> TrainResult:
        """Trains from the start or the latest checkpoint up to `max_steps` (default train.steps)."""
        try:
            return self._run(resume, max_steps)
        finally:
            self.student.close()
            self.world.close()

    def _save(self, step: int, loader: LoaderState) -> Path:
        """A checkpoint after `step`, whose data order resumes at `loader`."""
        return save_checkpoint(
            self.checkpoint_root,
            step,
            student=self.student,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            loader=loader,
            teachers=self.teacher_list,
            run=self.run_record,
            keep=self.tc.checkpoint.keep,
            world=self.world,
        )

    def _run(self, resume: bool | None, max_steps: int | None) -> TrainResult:
        point = self._resume_point(resume)
        if point is None:
            self.start_from()
        first = (point.step if point else 0) + 1
        last = min(self.tc.steps, max_steps if max_steps is not None else self.tc.steps)
        result = TrainResult(
            self.output, first, last, None, 0, self.heads_by_rank, reports=self.world.rank == 0
        )
        if first > last:
            self.log(f"nothing to train: the run in {self.output} is at step {first - 1} of {last}")
            return result
        metrics = (
            MetricsLog(self.output, resume_step=point.step if point else None)
            if self.world.rank == 0
            else None
        )

        def emit(record: Record, line: str) -> None:
            result.records.append(record)
            if metrics is not None:
                metrics.write(record)
            self.log(line)

        if first == 1 and self.eval_rows.shape[0]:
            evaluated = self.evaluate(0)
            emit(evaluated, eval_line(evaluated))
        self.log(f"training steps {first}..{last}; reading step {first}'s rows")
        steps = self.loader.steps(point.loader if point else LoaderState(self.tc.seed))
        clock = StepClock()
        try:
            for step in range(first, last + 1):
                with clock.waiting():
                    batch = next(steps)
                outcome = self.train_step(step, batch)
                record = TrainRecord(**outcome, **clock.lap(outcome["tokens"]))
                emit(record, step_line(record, self.tc.steps))
                if step % self.tc.checkpoint.every == 0 or step == last:
                    result.checkpoint = self._save(step, batch.state_after)
                if self._should_eval(step, last):
                    evaluated = self.evaluate(step)
                    emit(evaluated, eval_line(evaluated))
        finally:
            steps.close()
            if metrics is not None:
                metrics.close()
        result.heads_peak_resident = self.heads.peak_resident
        if metrics is not None and metrics.path.stat().st_size:
            self.log(f"metrics: {metrics.path}; plot: {plot_metrics(metrics.path, self.output / PLOT_FILE)}")
        return result


def run_training(
    config: MopdConfig,
    *,
    store_path: str | Path | None = None,
    output: str | Path | None = None,
    resume: bool | None = None,
    max_steps: int | None = None,
    log: Log = print,
) -> TrainResult:
    """Builds the trainer and runs it (see `Trainer.run`)."""
    return Trainer(config, store_path=store_path, output=output, log=log).run(
        resume=resume, max_steps=max_steps
    )
