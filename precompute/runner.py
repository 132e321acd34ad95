"""`mopd precompute`: plan the store, run this job's share of the tasks, finalize when all are done.

Each job loads each teacher at most once, skips tasks whose part record exists, and the job that
completes the last task writes the manifest. Jobs share nothing but the store, so N jobs on N machines
(`--num-tasks N --task-index I`, or a SLURM array) fill one store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import numpy as np

from mopd.base.batching import pack_batches, select_tasks
from mopd.base.devices import check_device, rank_device
from mopd.base.errors import ConfigError
from mopd.config.mopd_config import MopdConfig
from mopd.config.precompute import PrecomputeConfig
from mopd.precompute.backends import HiddenStateSource, TeacherModel, load_teacher
from mopd.precompute.ingest import ingest_cache, ingest_rows, publish_ingest_records
from mopd.precompute.outputs import NoOutput, Output, StoreOutput
from mopd.precompute.plan import build_plan, compute_dtype
from mopd.precompute.progress import TokenProgress
from mopd.precompute.rows import TokenizedRows
from mopd.precompute.teachers import (
    TeacherSet,
    resolve_teachers,
    teacher_projection,
)
from mopd.store.codec.int8_rotated import CALIBRATION_TOKENS, Calibration
from mopd.store.format.layout import shard_rows
from mopd.store.format.manifest import (
    EncodingTask,
    HeadTask,
    Manifest,
    Plan,
    ProjectionTask,
    RowsTask,
    ShardTask,
)
from mopd.store.locations.location import Location, open_location
from mopd.store.writer import StoreWriter

Task: TypeAlias = RowsTask | HeadTask | ShardTask | EncodingTask | ProjectionTask


@dataclass
class TeacherStats:
    rows: int = 0
    tokens: int = 0
    bytes: int = 0


@dataclass
class PrecomputeResult:
    store: str  # the store's path or URL
    tasks_total: int
    tasks_selected: int
    tasks_computed: list[str]
    tasks_skipped: int
    num_truncated: int
    num_dropped: int
    manifest: Manifest | None
    per_teacher: dict[int, TeacherStats] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    writes: bool = True  # False on a megatron rank that computes for its group's writer
    published: bool = False  # this job published the manifest (a racing finalize may have won)


def slurm_task_split() -> tuple[int, int] | None:
    """(num_tasks, task_index) from a SLURM job array, if this process is one of its tasks."""
    if "SLURM_ARRAY_TASK_ID" not in os.environ or "SLURM_ARRAY_TASK_COUNT" not in os.environ:
        return None
    first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    return int(os.environ["SLURM_ARRAY_TASK_COUNT"]), int(os.environ["SLURM_ARRAY_TASK_ID"]) - first


class JobRanks(Protocol):
    """The ranks of one precompute job: this process alone, or a megatron model-parallel group whose lead
    writes the store and hands the others their share of the tasks."""

    @property
    def is_lead(self) -> bool: ...  # the rank that writes the job's store

    @property
    def dp_size(self) -> int: ...  # the world's jobs (model-parallel groups), each one job of the split
    @property
    def dp_rank(self) -> int: ...

    def share(self, items: list[Any]) -> list[Any]: ...  # the lead's list, on every rank
    def wait_for_world(self) -> None: ...  # returns once every job of the world is done
    def __enter__(self) -> object: ...
    def __exit__(self, *exc: object) -> None: ...


class OneProcess:
    """The ranks of a job that computes in this process (hf, vllm): itself, the only job of its world."""

    is_lead = True
    dp_size = 1
    dp_rank = 0

    def share(self, items: list[Any]) -> list[Any]:
        return items

    def wait_for_world(self) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> OneProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to end."""


def start_job(
    backend: str, settings: PrecomputeConfig, num_tasks: int, task_index: int
) -> tuple[JobRanks, int, int]:
    """The job's ranks, which the caller ends (`with`), and its share of the tasks as (num_tasks,
    task_index): each tp × pp group of a megatron world is one job of the split."""
    if backend != "megatron":  # the one backend whose job spans ranks
        ranks: JobRanks = OneProcess()
    else:
        from mopd.mcore.parallel import ModelParallelGroup

        ranks = ModelParallelGroup.start(
            settings.parallel, rank_device(settings.device), what="precompute.parallel"
        )
    return ranks, num_tasks * ranks.dp_size, task_index * ranks.dp_size + ranks.dp_rank


def task_batches(
    task: ShardTask, rows: TokenizedRows, batch_tokens: int, *, own: bool = False
) -> list[np.ndarray]:
    """The row batches of a hidden-state task, in processing order (the same on every rank); `own`: a
    teacher of another tokenizer, whose rows are its own tokens."""
    row_ids = shard_rows(rows.teacher_index, task, rows.teacher_set)
    return pack_batches(row_ids, rows.token_rows(own)[1][row_ids], batch_tokens=batch_tokens)


def run_hidden_task(
    output: Output,
    task: ShardTask,
    teacher: HiddenStateSource,
    rows: TokenizedRows,
    batch_tokens: int,
    progress: TokenProgress,
    own: bool,
) -> None:
    batches = task_batches(task, rows, batch_tokens, own=own)
    order = np.concatenate(batches)  # stored in processing order; the shard records it in row_ids
    tokens, lengths = rows.token_rows(own)
    with output.shard(task, teacher, rows, order) as append:
        for batch in batches:
            append(batch, teacher.hidden_states([tokens[r] for r in batch]))
            progress.advance(rows=len(batch), tokens=int(lengths[batch].sum()))


def run_encoding_task(
    output: Output,
    task: EncodingTask,
    teacher: TeacherModel,
    rows: TokenizedRows,
    batch_tokens: int,
    own: bool,
) -> None:
    """Fits the teacher's encoding on its first rows, as many as fit in `CALIBRATION_TOKENS` (at least
    one), batched as a shard's rows are."""
    tokens, all_lengths = rows.token_rows(own)
    row_ids = rows.rows_of(task.teacher)
    lengths = all_lengths[row_ids]
    row_ids = row_ids[: max(1, int(np.searchsorted(np.cumsum(lengths), CALIBRATION_TOKENS, side="right")))]
    calibration = Calibration()
    for batch in pack_batches(row_ids, all_lengths[row_ids], batch_tokens=batch_tokens):
        calibration.add(teacher.hidden_states([tokens[r] for r in batch]))
    output.encoding(task, teacher, calibration)


def run_teacher_tasks(
    output: Output,
    teacher: TeacherModel,
    tasks: list[HeadTask | ShardTask | EncodingTask],
    rows: TokenizedRows,
    batch_tokens: int,
    progress: TokenProgress,
    own: bool = False,
) -> None:
    """One loaded teacher's tasks, after the proof that its capture rebuilds its logits; closes it.
    `own`: a teacher of another tokenizer, which reads its own token rows."""
    try:
        index = tasks[0].teacher
        tokens = rows.token_rows(own)[0]
        first_rows = [tokens[r] for r in rows.rows_of(index)[:4]]
        output.check_capture(teacher, first_rows or [rows.input_ids[0][:16]])
        for task in tasks:
            if isinstance(task, HeadTask):
                output.head(task, teacher)
            elif isinstance(task, EncodingTask):
                run_encoding_task(output, task, teacher, rows, batch_tokens, own)
            else:
                run_hidden_task(output, task, teacher, rows, batch_tokens, progress, own)
    finally:
        teacher.close()


def open_output(store: Location, plan: Plan, hidden_dtype: str, ranks: JobRanks) -> Output:
    """The store, for a job's writer; nothing, for the other ranks of a megatron group."""
    if ranks.is_lead:
        return StoreOutput(StoreWriter.open(store, plan), hidden_dtype)
    return NoOutput()


def describe_share(
    store: str, plan: Plan, share: Share, rows: TokenizedRows, output: Output, max_length: int
) -> str:
    removed = len(output.removed)
    return (
        f"store {store}: {len(plan.tasks)} tasks, {len(share.selected)} for this job ({len(share.skipped)} "
        f"already done); {rows.num_rows} rows, {int(rows.lengths.sum())} tokens, {rows.num_truncated} "
        f"truncated and {rows.num_dropped} dropped at data.max_length {max_length}"
        + (f"; removed {removed} temporaries of stopped jobs" if removed else "")
    )


@dataclass(frozen=True)
class Share:
    """This job's tasks: those the split gives it, those of them already done, and those left to run
    (in plan order; on every rank of a megatron group, its writer's list)."""

    selected: set[str]
    skipped: set[str]
    todo: list[Task]


def job_share(plan: Plan, output: Output, ranks: JobRanks, num_tasks: int, task_index: int) -> Share:
    split = [t.task_id for t in plan.tasks if not isinstance(t, EncodingTask)]
    selected = set(select_tasks(split, num_tasks=num_tasks, task_index=task_index))
    done = output.done()
    selected |= encodings_for(plan, selected, done)
    todo = ranks.share([t.task_id for t in plan.tasks if t.task_id in selected and t.task_id not in done])
    chosen = set(todo)
    return Share(selected, selected & done, [t for t in plan.tasks if t.task_id in chosen])


def encodings_for(plan: Plan, selected: set[str], done: set[str]) -> set[str]:
    """The encoding tasks (an int8-rotated store's) of a job: a teacher's goes with its first shard, and to
    every job with a shard of that teacher left to do. The first job to finish one publishes it; the
    others adopt that one (`StoreOutput.encoding`)."""
    shards = [t for t in plan.tasks if isinstance(t, ShardTask) and t.task_id in selected]
    teachers = {t.teacher for t in shards if t.shard == 0 or t.task_id not in done}
    return {t.task_id for t in plan.tasks if isinstance(t, EncodingTask) and t.teacher in teachers}


def run_tasks(
    output: Output,
    todo: list[Task],
    teachers: TeacherSet,
    rows: TokenizedRows,
    settings: PrecomputeConfig,
    backend: str,
    ranks: JobRanks,
    show_progress: bool,
    log: Callable[[str], Any] = print,
) -> float:
    """Every task of `todo` through the function of its kind; each teacher is loaded once, for all of
    its tasks, one teacher at a time. Returns the tokens per second of the hidden-state tasks."""
    start = time.perf_counter()
    with TokenProgress(**hidden_totals(todo, rows, teachers.cross), enabled=show_progress) as progress:
        for task in (t for t in todo if isinstance(t, RowsTask)):
            output.rows(task, rows)
        for task in (t for t in todo if isinstance(t, ProjectionTask)):  # tokenizers only, no forward
            output.projection(task, teacher_projection(teachers, task.teacher, settings.trust_remote_code))
        for number, slot in enumerate(teachers.slots, start=1):
            mine = [
                t
                for t in todo
                if isinstance(t, HeadTask | ShardTask | EncodingTask) and t.teacher == slot.index
            ]
            if mine:
                progress.describe(f"{'+'.join(slot.aliases)} ({number}/{len(teachers.slots)} teachers)")
                own = slot.index in teachers.cross  # a teacher of another tokenizer reads its own rows
                length = int(rows.token_rows(own)[1].max())
                teacher = load_teacher(
                    settings, backend, slot.checkpoint, max_model_len=length, group=ranks, log=log
                )
                run_teacher_tasks(output, teacher, mine, rows, settings.batch_tokens, progress, own)
    return progress.tokens / max(time.perf_counter() - start, 1e-9)


def hidden_totals(todo: list[Task], rows: TokenizedRows, cross: Collection[int] = ()) -> dict[str, int]:
    """Rows and tokens of the hidden-state tasks of `todo` (each row is in exactly one such task), in
    the tokens each teacher reads (`cross`: the teachers of other tokenizers)."""
    shards = [t for t in todo if isinstance(t, ShardTask)]
    row_ids = [shard_rows(rows.teacher_index, t, rows.teacher_set) for t in shards]
    return {
        "total_rows": sum(r.shape[0] for r in row_ids),
        "total_tokens": sum(
            int(rows.token_rows(t.teacher in cross)[1][r].sum()) for t, r in zip(shards, row_ids, strict=True)
        ),
    }


def precompute_result(
    store: str,
    plan: Plan,
    share: Share,
    rows: TokenizedRows,
    manifest: Manifest | None,
    tokens_per_s: float,
    output: Output,
) -> PrecomputeResult:
    totals: dict[int, TeacherStats] = {}
    for shard in manifest.shards if manifest is not None else []:
        stats = totals.setdefault(shard.teacher, TeacherStats())
        stats.rows += shard.rows
        stats.tokens += shard.tokens
        stats.bytes += shard.bytes
    return PrecomputeResult(
        store=store,
        tasks_total=len(plan.tasks),
        tasks_selected=len(share.selected),
        tasks_computed=[t.task_id for t in share.todo],
        tasks_skipped=len(share.skipped),
        num_truncated=rows.num_truncated,
        num_dropped=rows.num_dropped,
        manifest=manifest,
        per_teacher=totals,
        tokens_per_s=tokens_per_s,
        writes=output.writes,
        published=output.published,
    )


def probed_location(where: str | Path, options: dict[str, str]) -> Location:
    """The store's location; a bucket without conditional writes is refused here, before the dataset is
    tokenised (a folder is probed when its writer opens it, as ingest writes there first)."""
    location = open_location(str(where), options)
    if location.remote:
        location.prepare()
    return location


@contextmanager
def hub_offline() -> Iterator[None]:
    """`HF_HUB_OFFLINE=1` for a job (mopd never downloads at run time, and the vLLM engine processes it
    starts inherit the setting); the caller's environment as it was afterwards."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)


def job_teachers(config: MopdConfig, backend: str) -> TeacherSet:
    """The job's teachers (`resolve_teachers`), against the store's tokenizer: `tokenizer`, or the
    student's where the teachers' is not its own.

    Raises:
        ConfigError: as `resolve_teachers`, or a teacher of another tokenizer for the megatron backend.
    """
    student = config.train.student if config.train is not None else None
    teachers = resolve_teachers(config.teachers, config.tokenizer, student)
    if teachers.cross and backend == "megatron":
        raise ConfigError(
            f"precompute.backend megatron: teachers {sorted(teachers.cross)} have another tokenizer "
            "than the store's, and the megatron backend computes teachers of the store's tokenizer "
            "only (its task loop feeds every rank the store's token rows); use the hf or vllm backend"
        )
    return teachers


def run_precompute(
    config: MopdConfig,
    *,
    store_path: str | Path | None = None,
    backend: str | None = None,
    num_tasks: int = 1,
    task_index: int = 0,
    show_progress: bool = True,
    log: Callable[[str], Any] = print,
) -> PrecomputeResult:
    """Runs this job's share of the precompute and finalizes the store if every task is done.

    Raises ConfigError (bad config, data or checkpoints), ManifestError (the store path holds another
    run's store) or StoreIntegrityError (non-finite teacher outputs, a published task changed).
    """
    with hub_offline():
        settings = config.precompute.with_backend(backend)
        backend = settings.backend
        check_device(settings.device, key="precompute.device")
        location = probed_location(store_path or config.store.path, config.store.options)
        teachers = job_teachers(config, backend)
        cache = ingest_cache(location)
        rows = ingest_rows(config, teachers, cache, show_progress=show_progress, log=log)
        plan = build_plan(config, teachers, rows, backend, compute_dtype(settings))

        ranks, num_tasks, task_index = start_job(backend, settings, num_tasks, task_index)
        with ranks:  # a megatron job's model-parallel state ends with the job, however it ends
            output = open_output(location, plan, config.store.dtype, ranks)
            share = job_share(plan, output, ranks, num_tasks, task_index)
            if output.writes:
                publish_ingest_records(location, cache)
                log(describe_share(location.url, plan, share, rows, output, config.data.max_length))

            progress = show_progress and output.writes
            tokens_per_s = run_tasks(
                output, share.todo, teachers, rows, settings, backend, ranks, progress, log
            )
            manifest = output.finalize()
            ranks.wait_for_world()  # every rank returns once its world's stores are written, the manifest too
        return precompute_result(location.url, plan, share, rows, manifest, tokens_per_s, output)
