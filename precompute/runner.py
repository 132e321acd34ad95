"""`mopd precompute`: plan the store, run this job's share of the tasks, finalize when all are done.

Each job loads each teacher at most once, skips tasks whose part record exists, and the job that
completes the last task writes the manifest. Jobs share nothing but the store, so N jobs on N machines
(`--num-tasks N --task-index I`, or a SLURM array) fill one store.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mopd.precompute.data import TokenizedRows
from mopd.precompute.hf_backend import HFTeacher, resolve_dtype
from mopd.precompute.ingest import INGEST_DIR, ingest
from mopd.precompute.progress import TokenProgress
from mopd.precompute.teachers import TeacherSet, load_tokenizer, resolve_teachers
from mopd.store.batching import pack_batches, select_tasks
from mopd.store.config import MopdConfig
from mopd.store.devices import resolve_device
from mopd.store.errors import ConfigError, StoreIntegrityError
from mopd.store.layout import plan_tasks, shard_rows
from mopd.store.manifest import (
    DatasetInfo,
    HeadTask,
    Manifest,
    Plan,
    RowsTask,
    ShardTask,
    StorageInfo,
    TeacherInfo,
    TokenizerInfo,
)
from mopd.store.tasks import HiddenShardWriter, write_lm_head, write_rows
from mopd.store.transform import LogitTransform
from mopd.store.version import __version__
from mopd.store.writer import StoreWriter

# The inner chunk: the unit a read decodes (bench/README.md, "scale.py", measures the choice).
CHUNK_BYTES = 256 << 10
_STORAGE_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class TeacherStats:
    rows: int = 0
    tokens: int = 0
    bytes: int = 0


@dataclass
class PrecomputeResult:
    store: Path
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


def slurm_task_split() -> tuple[int, int] | None:
    """(num_tasks, task_index) from a SLURM job array, if this process is one of its tasks."""
    if "SLURM_ARRAY_TASK_ID" not in os.environ or "SLURM_ARRAY_TASK_COUNT" not in os.environ:
        return None
    first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    return int(os.environ["SLURM_ARRAY_TASK_COUNT"]), int(os.environ["SLURM_ARRAY_TASK_ID"]) - first


def build_plan(
    config: MopdConfig, teachers: TeacherSet, rows: TokenizedRows, backend: str, compute_dtype: str
) -> Plan:
    """The store's plan; everything in it decides the store's bytes, so equal plans give equal stores."""
    return Plan(
        tokenizer=TokenizerInfo(
            name=teachers.tokenizer_path, vocab_hash=teachers.vocab_hash, vocab_size=teachers.vocab_size
        ),
        dataset=DatasetInfo(
            source=config.data.path,
            fingerprint=rows.fingerprint(),
            num_rows=rows.num_rows,
            num_tokens=int(rows.lengths.sum()),
        ),
        teachers=[
            TeacherInfo(
                index=s.index,
                checkpoint=s.checkpoint,
                aliases=list(s.aliases),
                fingerprint=teachers.fingerprints[s.index],
                backend=backend,
            )
            for s in teachers.slots
        ],
        tasks=plan_tasks(
            rows.teacher_index,
            num_teachers=len(teachers.slots),
            rows_per_task=config.precompute.rows_per_task,
        ),
        storage=StorageInfo(
            hidden_dtype=config.store.dtype, codec=config.store.codec, chunk_bytes=CHUNK_BYTES
        ),
        config={
            "data": {
                "max_length": config.data.max_length,
                "overlong": config.data.overlong,
                "input_format": rows.input_format,
            },
            "routing": config.routing.model_dump(mode="json"),
            "precompute": {
                "rows_per_task": config.precompute.rows_per_task,
                "compute_dtype": compute_dtype,
                "trust_remote_code": config.precompute.trust_remote_code,
            },
        },
    )


class HiddenStateSource(Protocol):
    """What a hidden-state task needs of a loaded teacher."""

    checkpoint: str
    hidden_size: int

    def hidden_states(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]: ...


class TeacherModel(HiddenStateSource, Protocol):
    """A loaded teacher of any backend: hidden states, its output layer and the proof that they agree."""

    transform: LogitTransform

    def lm_head(self) -> torch.Tensor: ...

    def check_capture(self, rows: Sequence[np.ndarray]) -> float: ...

    def close(self) -> None: ...


def load_teacher(
    config: MopdConfig, backend: str, checkpoint: str, *, max_model_len: int, group: Any = None
) -> TeacherModel:
    """Loads one teacher checkpoint with `backend` (vllm and megatron are imported only when asked for;
    `group` is the megatron backend's ModelParallelGroup)."""
    pc = config.precompute
    if backend == "hf":
        return HFTeacher(checkpoint, device=pc.device, dtype=pc.dtype, trust_remote_code=pc.trust_remote_code)
    if backend == "vllm":
        from mopd.precompute.vllm_backend import VLLMTeacher

        return VLLMTeacher(
            checkpoint,
            max_model_len=max_model_len,
            batch_tokens=pc.batch_tokens,
            device=pc.device,
            dtype=pc.dtype,
            trust_remote_code=pc.trust_remote_code,
        )
    if backend == "megatron":
        from mopd.precompute.megatron_backend import MegatronTeacher

        return MegatronTeacher(
            checkpoint, group=group, dtype=pc.dtype, trust_remote_code=pc.trust_remote_code
        )
    raise ConfigError(f"precompute.backend {backend!r} is not one of hf, vllm, megatron")


def task_batches(task: ShardTask, rows: TokenizedRows, config: MopdConfig) -> list[np.ndarray]:
    """The row batches of a hidden-state task, in processing order (the same on every rank)."""
    row_ids = shard_rows(rows.teacher_index, task)
    return pack_batches(row_ids, rows.lengths[row_ids], batch_tokens=config.precompute.batch_tokens)


def follow_hidden_tasks(
    tasks: list[ShardTask], teachers: TeacherSet, rows: TokenizedRows, config: MopdConfig, group: Any
) -> None:
    """A megatron rank that is not its group's writer: runs every batch the writer runs, writes nothing."""
    for slot in teachers.slots:
        mine = [t for t in tasks if t.teacher == slot.index]
        if not mine:
            continue
        teacher = load_teacher(
            config, "megatron", slot.checkpoint, max_model_len=int(rows.lengths.max()), group=group
        )
        try:
            for task in mine:
                for batch in task_batches(task, rows, config):
                    teacher.hidden_states([rows.input_ids[r] for r in batch])
        finally:
            teacher.close()


def run_hidden_task(
    writer: StoreWriter,
    task: ShardTask,
    teacher: HiddenStateSource,
    rows: TokenizedRows,
    config: MopdConfig,
    progress: TokenProgress,
) -> None:
    lengths = rows.lengths
    batches = task_batches(task, rows, config)
    order = np.concatenate(batches)  # stored in processing order; the shard records it in row_ids
    storage_dtype = _STORAGE_TORCH_DTYPE[config.store.dtype]
    with writer.task(task.task_id) as out:
        shard = HiddenShardWriter(
            out,
            row_ids=order,
            lengths=lengths[order],
            hidden_size=teacher.hidden_size,
            dtype=config.store.dtype,
        )
        for batch in batches:
            hidden = teacher.hidden_states([rows.input_ids[r] for r in batch])
            for row, states in zip(batch, hidden, strict=True):
                if not torch.isfinite(states).all():
                    raise StoreIntegrityError(
                        f"teacher {task.teacher} ({teacher.checkpoint}) produced non-finite hidden states "
                        f"for row {row} (source key {rows.source_keys[row]}); nothing of the task was written"
                    )
                shard.append(int(row), states.to(storage_dtype))
            progress.advance(rows=len(batch), tokens=int(lengths[batch].sum()))
        shard.close()


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

    Raises:
        ConfigError: bad config, data or checkpoints (each message names what and how to fix it).
        ManifestError: the store path holds a store of another run.
        StoreIntegrityError: non-finite teacher outputs, or a published task with other content.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # mopd never downloads at run time
    backend = backend or config.precompute.backend
    parallel = config.precompute.parallel
    if backend != "megatron" and parallel.tp * parallel.pp > 1:
        raise ConfigError(
            f"precompute.parallel tp={parallel.tp} × pp={parallel.pp} needs the megatron backend (under "
            f"torchrun); the {backend} backend runs each teacher whole in one process: set tp = pp = 1 or "
            "use --backend megatron"
        )
    store = Path(store_path or config.store.path)
    teachers = resolve_teachers(config)
    rows = ingest(
        data=config.data,
        routing=config.routing,
        agent_to_alias=config.agent_to_alias(),
        alias_index=teachers.alias_index,
        tokenizer_path=teachers.tokenizer_path,
        load_tokenizer=lambda: load_tokenizer(
            teachers.tokenizer_path, trust_remote_code=config.precompute.trust_remote_code
        ),
        cache=store / INGEST_DIR,
        num_proc=config.data.num_proc or min(8, os.cpu_count() or 1),
        show_progress=show_progress,
        log=log,
    )
    device = resolve_device(config.precompute.device)
    compute_dtype = str(resolve_dtype(config.precompute.dtype, device)).removeprefix("torch.")
    plan = build_plan(config, teachers, rows, backend, compute_dtype)
    group = None
    if backend == "megatron":  # each tp × pp group of the world is one job of the task split
        from mopd.mcore.parallel import ModelParallelGroup

        group = ModelParallelGroup.start(
            config.precompute.parallel, config.precompute.device, what="precompute.parallel"
        )
        num_tasks, task_index = num_tasks * group.dp_size, task_index * group.dp_size + group.dp_rank
    selected = set(select_tasks([t.task_id for t in plan.tasks], num_tasks=num_tasks, task_index=task_index))
    if group is not None and not group.is_lead:
        todo_ids = set(group.share([]))
        follow_hidden_tasks(
            [t for t in plan.tasks if isinstance(t, ShardTask) and t.task_id in todo_ids],
            teachers,
            rows,
            config,
            group,
        )
        return PrecomputeResult(store, len(plan.tasks), len(selected), [], 0, 0, 0, None, writes=False)
    writer = StoreWriter.open(store, plan)
    done = writer.done_tasks()
    todo = [t for t in plan.tasks if t.task_id in selected and t.task_id not in done]
    if group is not None:
        group.share([t.task_id for t in todo])
    log(
        f"store {store}: {len(plan.tasks)} tasks, {len(selected)} for this job "
        f"({len(selected & done)} already done); {rows.num_rows} rows, {int(rows.lengths.sum())} tokens, "
        f"{rows.num_truncated} truncated and {rows.num_dropped} dropped at data.max_length "
        f"{config.data.max_length}"
    )
    computed: list[str] = []
    # Each row is in exactly one hidden task, so the job's totals are plain sums over its tasks.
    todo_rows = [shard_rows(rows.teacher_index, t) for t in todo if isinstance(t, ShardTask)]
    start = time.perf_counter()
    with TokenProgress(
        total_rows=sum(r.shape[0] for r in todo_rows),
        total_tokens=sum(int(rows.lengths[r].sum()) for r in todo_rows),
        enabled=show_progress,
    ) as progress:
        for task in todo:
            if isinstance(task, RowsTask):
                with writer.task(task.task_id) as out:
                    write_rows(
                        out,
                        input_ids=rows.input_ids.pieces(),
                        loss_mask=rows.loss_mask.pieces(),
                        offsets=rows.input_ids.offsets,
                        teacher_index=rows.teacher_index,
                        source_keys=rows.source_keys,
                    )
                computed.append(task.task_id)
        for slot in teachers.slots:
            mine = [t for t in todo if isinstance(t, HeadTask | ShardTask) and t.teacher == slot.index]
            if not mine:
                continue
            progress.describe(f"teacher {slot.index} ({', '.join(slot.aliases)})")
            teacher = load_teacher(
                config, backend, slot.checkpoint, max_model_len=int(rows.lengths.max()), group=group
            )
            try:
                first_rows = [rows.input_ids[r] for r in np.flatnonzero(rows.teacher_index == slot.index)[:4]]
                teacher.check_capture(first_rows or [rows.input_ids[0][:16]])
                for task in mine:
                    if isinstance(task, HeadTask):
                        with writer.task(task.task_id) as out:
                            write_lm_head(
                                out,
                                teacher.lm_head(),
                                logit_scale=teacher.transform.logit_scale,
                                final_logit_softcap=teacher.transform.final_logit_softcap,
                            )
                    else:
                        run_hidden_task(writer, task, teacher, rows, config, progress)
                    computed.append(task.task_id)
            finally:
                teacher.close()
    elapsed = time.perf_counter() - start
    manifest = writer.finalize(
        created_by=f"mopd {__version__}",
        volatile={"finalized_at": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node()},
    )
    result = PrecomputeResult(
        store=store,
        tasks_total=len(plan.tasks),
        tasks_selected=len(selected),
        tasks_computed=computed,
        tasks_skipped=len(selected & done),
        num_truncated=rows.num_truncated,
        num_dropped=rows.num_dropped,
        manifest=manifest,
        tokens_per_s=progress.tokens / elapsed if elapsed > 0 else 0.0,
    )
    if manifest is not None:
        for shard in manifest.shards:
            stats = result.per_teacher.setdefault(shard.teacher, TeacherStats())
            stats.rows += shard.rows
            stats.tokens += shard.tokens
            stats.bytes += shard.bytes
    return result
