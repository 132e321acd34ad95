"""`mopd train`: distil the student from the store (DESIGN §7).

One optimiser step: this replica's microbatches of the step run forward and backward (one at a time on
the hf backend, through megatron-core's pipeline schedule on the megatron backend), each token's loss
weighted by 1 / (the step's trained tokens over all data-parallel replicas) — or, at sequence level, by
1 / (its row's trained tokens × the step's trained rows over all replicas) — so the gradients summed over
the replicas are those of the global batch whatever the layout. Then the gradient norm is checked and
clipped, and AdamW steps under a linear-warmup, cosine-decay schedule.

Ranks: the world is torchrun's processes. On the hf backend each is a data-parallel replica holding the
whole student; on the fsdp backend each holds its shard of the student and of the AdamW state
(`backends/fsdp.py`). On the megatron backend the world splits into tp × pp model-parallel groups, one per
replica; only the last pipeline stage holds teacher heads (its TP rank's vocabulary slice) and computes
the loss, and its first TP rank reports the per-token statistics that rank 0 logs.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mopd.base.errors import ConfigError, MopdError, OutOfMemoryError
from mopd.base.fsio import write_replace
from mopd.config.mopd_config import EFFECTIVE_CONFIG_FILE, MopdConfig, dump_config
from mopd.train.checkpoint.resume import RunIdentity, init_checkpoint, resume_checkpoint
from mopd.train.checkpoint.run_record import run_record
from mopd.train.checkpoint.state import (
    ResumePoint,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from mopd.train.data.loader import MicroBatch, Step, StoreLoader
from mopd.train.data.order import LoaderState, epoch_steps
from mopd.train.objective import StepStats
from mopd.train.precision import pure_bf16_warning, unchanged_share
from mopd.train.report.memory import allocation_failure, estimate_peak, memory_settings
from mopd.train.report.metrics import (
    PLOT_FILE,
    Eta,
    EvalRecord,
    MetricsLog,
    Record,
    StepClock,
    StepOutcome,
    TeacherNames,
    TrainRecord,
    eval_line,
    plot_metrics,
    step_line,
    teacher_names,
)
from mopd.train.report.tracking import Trackers, check_trackers
from mopd.train.schedule import lr_factor, over_budget, schedule_warning
from mopd.train.session import Log, open_session
from mopd.train.store_check import check_store


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


def plan_line(loader: StoreLoader, seed: int, first: int, last: int) -> str:
    """What the run will train: its steps, and about how many tokens and epochs they are (from the
    first epoch's cut into steps; later epochs cut a little differently)."""
    per_epoch = len(
        epoch_steps(loader.lengths, seed=seed, epoch=0, global_batch_tokens=loader.global_batch_tokens)
    )
    count = last - first + 1
    tokens = count * int(loader.lengths.sum()) / per_epoch
    return (
        f"training steps {first}..{last}: {count:,} steps ≈ {tokens:,.0f} tokens ≈ {count / per_epoch:.3g} "
        f"epochs of {loader.rows.shape[0]:,} rows ({per_epoch:,} step{'s' if per_epoch > 1 else ''} an epoch)"
    )


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Trainer:
    """A training run: a session (`session.open_session`), the optimiser, the schedule and the data
    order. It closes its session when `run` ends, or when it fails to build; `close` ends it early."""

    def __init__(
        self,
        config: MopdConfig,
        *,
        store_path: str | Path | None = None,
        output: str | Path | None = None,
        log: Log = print,
    ) -> None:
        if config.train is not None:
            check_trackers(config.train.report_to)  # before the student loads
        self.session = open_session(config, store_path=store_path, log=log)
        try:
            self._prepare(config, output)
        except BaseException:
            self.session.close()
            raise

    def _prepare(self, config: MopdConfig, output: str | Path | None) -> None:
        """The data order, the optimiser and the schedule, over the session's student and store."""
        session = self.session
        # The session's parts the loop uses, and a caller of the trainer (a test, a benchmark) reads.
        self.store, self.student, self.world = session.store, session.student, session.world
        self.objective, self.heads = session.objective, session.heads
        self.config = config
        self.tc = tc = session.config
        self.log = session.log
        self.output = Path(output or tc.output_dir)
        held = held_out_rows(self.store.num_rows, tc.eval.rows, tc.seed) if tc.eval.rows else np.zeros(0, int)
        self.eval_rows = held
        self.loader = StoreLoader(
            self.store,
            np.setdiff1d(np.arange(self.store.num_rows), held),
            micro_batch_tokens=tc.batch.micro_batch_tokens,
            global_batch_tokens=tc.batch.global_batch_tokens,
            dp_rank=session.replicas.rank,
            dp_size=session.replicas.size,
            prefetch=tc.prefetch,
            with_teacher_states=self.student.holds_loss,
            spans=self.objective.span_weight > 0 and bool(session.cross_teachers),
        )
        for warning in (
            over_budget(tc.batch, int(self.store.lengths.max(initial=0))),
            schedule_warning(tc.optim.warmup_steps, tc.steps, tc.optim.lr),
        ):
            if warning:
                self.log(warning)
        self.optimizer = self.student.optimizer(lr=tc.optim.lr, weight_decay=tc.optim.weight_decay)
        if tc.dtype == "bfloat16":
            self.log(
                pure_bf16_warning(unchanged_share(self.student.local_parameters(), tc.optim.lr), tc.optim.lr)
            )
        self.log(self._memory_estimate())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=tc.optim.warmup_steps, total=tc.steps)
        )
        self.identity = RunIdentity(
            store=self.store.root,
            teachers=session.teacher_list,
            run=run_record(tc, self.store.manifest, self.session.projection_fingerprints),
            layout=self.student.layout,
        )

    def _memory_estimate(self) -> str:
        hidden, layers = self.student.decoder_shape
        estimate = estimate_peak(
            self.student.local_parameters(),
            tc=self.tc,
            hidden_size=hidden,
            layers=layers,
            vocab_rows=self.objective.local_rows if self.student.holds_loss else 0,
            chunk_size=self.objective.chunk_size,
            heads_bytes=self.heads.held_bytes,
            optimizer_shards=self.student.optimizer_shards,
        )
        return estimate.line(self.session.device)

    @contextmanager
    def _bounded_memory(self, what: str) -> Iterator[None]:
        """An allocation failure in the block becomes one line naming the settings that bound memory."""
        try:
            yield
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
            failure = allocation_failure(err)
            if failure is None:
                raise
            raise OutOfMemoryError(
                f"{what}: out of memory on rank {self.world.rank} ({self.session.device}): {failure}. "
                f"What bounds memory: {memory_settings(self.tc, self.objective.chunk_size)}; lower "
                "micro_batch_tokens or chunk_size, or turn on activation_checkpointing (the estimate "
                "before step 1 shows each part)"
            ) from err

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the session (its process groups); `run` does this when it returns or fails."""
        self.session.close()

    @property
    def checkpoint_root(self) -> Path:
        return self.output / "checkpoints"

    def _resume_point(self, resume: bool | None) -> ResumePoint | None:
        found = resume_checkpoint(
            self.checkpoint_root, resume=resume, identity=self.identity, world=self.world, log=self.log
        )
        if found is None:
            return None
        point = load_checkpoint(
            found.folder,
            found.state,
            student=self.student,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )
        self.log(f"resuming from {found.folder} (step {point.step})")
        return point

    def start_from(self) -> None:
        """A new run that starts from `train.init_from`'s weights (and optionally optimizer state)."""
        init = self.tc.init_from
        if init is None:
            return
        found = init_checkpoint(init, layout=self.student.layout, world=self.world)
        optimizer = self.optimizer if init.optimizer else None
        load_weights(found.folder, found.state, self.student, optimizer, hyper_parameters=False)
        state = "weights and optimizer state" if init.optimizer else "weights"
        self.log(f"new run starting from the {state} of {found.folder}")

    def _token_norm(self, mb: MicroBatch, denominator: float) -> torch.Tensor:
        if self.tc.divergence.level == "token":
            return torch.full((mb.num_trained,), 1.0 / denominator, device=self.session.device)
        per_row = mb.loss_mask.sum(1).to(torch.float32)
        return 1.0 / (per_row[mb.token_row] * denominator)

    def _global_denominator(self, microbatches: list[MicroBatch]) -> tuple[float, float]:
        """(normaliser of the loss, all tokens of the step), both summed over the replicas."""
        trained = sum(mb.num_trained for mb in microbatches)
        rows = sum(int(mb.loss_mask.any(1).sum()) for mb in microbatches)
        tokens = sum(mb.num_tokens for mb in microbatches)
        counts = self.session.replicas.all_reduce(torch.tensor([trained, rows, tokens], dtype=torch.float64))
        denominator = counts[0] if self.tc.divergence.level == "token" else counts[1]
        return float(denominator), float(counts[2])

    def train_step(self, step: int, batch: Step) -> StepOutcome:
        """Forward and backward of this replica's microbatches, gradient sum over the replicas, optimiser
        step."""
        self.optimizer.zero_grad(set_to_none=True)
        denominator, tokens = self._global_denominator(batch.microbatches)
        if denominator == 0:  # every replica sees the same sum: all of them refuse
            raise MopdError(
                f"step {step}: none of its rows has a trained token (every loss_mask is 0), so there is "
                "no gradient to take; the store's data has too few trained tokens for "
                f"train.batch.global_batch_tokens {self.tc.batch.global_batch_tokens}: leave out rows "
                "without any, or precompute rows whose loss_mask marks what to distil"
            )
        stats = StepStats(self.session.num_teachers, self.session.cross_teachers, self.session.teacher_sets)
        norm_of = lambda mb: self._token_norm(mb, denominator)  # noqa: E731
        self.student.forward_backward(batch.microbatches, self.session.loss_fn(stats, norm_of, train=True))
        self.student.finish_gradients()
        stats.reduce(self.world)
        grad_norm = self.student.clip_gradients(self.tc.optim.grad_clip)
        if stats.nonfinite.any() or not math.isfinite(grad_norm) or not math.isfinite(float(stats.loss)):
            self._refuse_nonfinite(step, stats, grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        outcome = StepOutcome(
            step=step,
            loss=float(stats.loss),
            **stats.divergences(),
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(tokens),
            memory_gib=_memory_gib(self.session.device),
        )
        if stats.ce is not None:
            outcome["ce"] = float(stats.ce)
        if stats.span is not None:
            outcome["span"] = float(stats.span)
        return outcome

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
        latest = latest_checkpoint(self.checkpoint_root)
        kept = (
            f"the last complete checkpoint {latest} is untouched" if latest else "no checkpoint was written"
        )
        raise NonFiniteError(
            f"step {step}: {where}; the step was not applied and {kept}. Lower train.optim.lr or check the "
            "store with `mopd verify-manifest --full`"
        )

    def evaluate(self, step: int) -> EvalRecord:
        """Mean divergence per trained token of the held-out rows, by teacher (no weighting, no CE)."""
        return self.session.evaluate(self.eval_rows, step=step)

    def _should_eval(self, step: int, last: int) -> bool:
        every = self.tc.eval.every
        return self.eval_rows.shape[0] > 0 and (step == last or (every > 0 and step % every == 0))

    def run(self, *, resume: bool | None = None, max_steps: int | None = None) -> TrainResult:
        """Trains from the start or the latest checkpoint up to `max_steps` (default train.steps)."""
        try:
            return self._run(resume, max_steps)
        finally:
            self.session.close()

    def _save(self, step: int, loader: LoaderState, tracking: dict[str, str]) -> Path:
        """A checkpoint after `step`, whose data order resumes at `loader`; one line says so."""
        saved = save_checkpoint(
            self.checkpoint_root,
            step,
            student=self.student,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            loader=loader,
            teachers=self.identity.teachers,
            run=self.identity.run,
            keep=self.tc.checkpoint.keep,
            world=self.world,
            tracking=tracking,
        )
        self.log(f"saved checkpoint {saved} (a resume starts after step {step})")
        return saved

    def _run(self, resume: bool | None, max_steps: int | None) -> TrainResult:
        point = self._resume_point(resume)
        check_store(self.config, self.store.manifest, self.store.location, world=self.world, log=self.log)
        if point is None:
            self.start_from()
        first = (point.step if point else 0) + 1
        last = min(self.tc.steps, max_steps if max_steps is not None else self.tc.steps)
        result = TrainResult(
            self.output, first, last, None, 0, self.session.heads_by_rank, reports=self.world.rank == 0
        )
        if first > last:
            self.log(f"nothing to train: the run in {self.output} is at step {first - 1} of {last}")
            return result
        names = teacher_names(self.store.manifest.teachers)
        report = Report(result, self.log, names)
        try:
            if self.world.rank == 0:
                report.open(self.output, self.config, point)
            if first == 1 and self.eval_rows.shape[0]:
                with self._bounded_memory("the evaluation before step 1"):
                    evaluated = self.evaluate(0)
                report.emit(evaluated, eval_line(evaluated, names))
            self.log(plan_line(self.loader, self.tc.seed, first, last) + f"; reading step {first}'s rows")
            self._train_steps(first, last, point, report)
        finally:
            report.close()
        result.heads_peak_resident = self.heads.peak_resident
        if report.metrics is not None and report.metrics.path.stat().st_size:
            plot = plot_metrics(report.metrics.path, self.output / PLOT_FILE)
            self.log(f"metrics: {report.metrics.path}; plot: {plot}")
        return result

    def _train_steps(self, first: int, last: int, point: ResumePoint | None, report: Report) -> None:
        steps = self.loader.steps(point.loader if point else LoaderState(self.tc.seed))
        clock, eta = StepClock(), Eta()
        try:
            for step in range(first, last + 1):
                with clock.waiting():
                    batch = next(steps)
                with self._bounded_memory(f"step {step}"):
                    outcome = self.train_step(step, batch)
                record = TrainRecord(**outcome, **clock.lap(outcome["tokens"]))
                eta.add(record["step_seconds"])
                report.emit(
                    record, step_line(record, self.tc.steps, report.names, eta.remaining(last - step))
                )
                if step % self.tc.checkpoint.every == 0 or step == last:
                    report.result.checkpoint = self._save(step, batch.state_after, report.tracking())
                if self._should_eval(step, last):
                    with self._bounded_memory(f"the evaluation after step {step}"):
                        evaluated = self.evaluate(step)
                    report.emit(evaluated, eval_line(evaluated, report.names))
        finally:
            steps.close()


class Report:
    """Where a run's records go: the result and the console on every rank; on rank 0 (once `open`)
    also metrics.jsonl and the trackers of `train.report_to`."""

    def __init__(self, result: TrainResult, log: Log, names: TeacherNames) -> None:
        self.result, self.log, self.names = result, log, names
        self.metrics: MetricsLog | None = None
        self.trackers: Trackers | None = None

    def open(self, output: Path, config: MopdConfig, point: ResumePoint | None) -> None:
        assert config.train is not None
        self.metrics = MetricsLog(output, resume_step=point.step if point else None, names=self.names)
        # what this run trains with, command-line overrides included
        write_replace(output / EFFECTIVE_CONFIG_FILE, dump_config(config).encode())
        self.trackers = Trackers(
            config.train.report_to,
            output,
            name=output.resolve().name,
            config=config.model_dump(mode="json"),
            names=self.names,
            resumed=point.tracking if point else None,
            resume_step=point.step if point else None,
        )
        for line in self.trackers.where():
            self.log(line)

    def emit(self, record: Record, line: str) -> None:
        self.result.records.append(record)
        if self.metrics is not None:
            self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record)
        self.log(line)

    def tracking(self) -> dict[str, str]:
        """The tracker runs a checkpoint keeps, for a resume to append to."""
        return self.trackers.identities() if self.trackers is not None else {}

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.trackers is not None:
            self.trackers.close()


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
    with Trainer(config, store_path=store_path, output=output, log=log) as trainer:
        return trainer.run(resume=resume, max_steps=max_steps)
