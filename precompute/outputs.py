"""Where a job's finished tasks go: into the store, or — on a megatron rank that only computes for its
group's writer — nowhere. Both take the same calls, so that every rank runs the one task loop of
`runner.py` and the ranks of a group run the same forwards in the same order."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from mopd.base.errors import StoreIntegrityError
from mopd.base.version import __version__
from mopd.precompute.backends import HiddenStateSource, TeacherModel
from mopd.precompute.rows import TokenizedRows
from mopd.store.arrays.dtypes import TORCH_DTYPES
from mopd.store.codec.int8_rotated import Calibration, Encoding
from mopd.store.format.loading import load_part
from mopd.store.format.manifest import (
    EXACT,
    EncodingTask,
    HeadTask,
    Manifest,
    ProjectionTask,
    RowsTask,
    ShardTask,
)
from mopd.store.task_writers import (
    HiddenShardWriter,
    read_encoding,
    write_alignment,
    write_encoding,
    write_lm_head,
    write_projection,
    write_rows,
)
from mopd.store.writer import StoreWriter
from mopd.tokens.projection import Projection

# What a shard of a teacher of another tokenizer stores (`write_alignment`'s arguments) from which of the
# ingested rows' cross columns.
CROSS_ARRAYS = {
    "token_ids": "teacher_ids",
    "teacher_span": "teacher_span",
    "aligned": "aligned",
    "student_span": "student_span",
}

# A hidden-state shard as its task fills it, a batch at a time: append(row ids, their [L_i, H] states).
AppendStates = Callable[[np.ndarray, list[torch.Tensor]], None]


class StoreOutput:
    """A job's writer: each finished task is published into the store; the last job finalizes it."""

    writes = True

    def __init__(self, writer: StoreWriter, hidden_dtype: str) -> None:
        self.writer, self.hidden_dtype = writer, hidden_dtype
        self._encodings: dict[int, Encoding] = {}  # teacher -> its published encoding

    def done(self) -> set[str]:
        return self.writer.done_tasks()

    def check_capture(self, teacher: TeacherModel, rows: Sequence[np.ndarray]) -> None:
        teacher.check_capture(rows)

    def rows(self, task: RowsTask, rows: TokenizedRows) -> None:
        with self.writer.task(task.task_id) as out:
            write_rows(
                out,
                input_ids=rows.input_ids.pieces(),
                loss_mask=rows.loss_mask.pieces(),
                offsets=rows.input_ids.offsets,
                teacher_index=rows.teacher_index,
                source_keys=rows.source_keys,
                teacher_set=rows.teacher_set,
            )

    def head(self, task: HeadTask, teacher: TeacherModel) -> None:
        with self.writer.task(task.task_id) as out:
            write_lm_head(
                out,
                teacher.lm_head(),
                logit_scale=teacher.transform.logit_scale,
                final_logit_softcap=teacher.transform.final_logit_softcap,
            )

    def projection(self, task: ProjectionTask, projection: Projection) -> None:
        with self.writer.task(task.task_id) as out:
            write_projection(
                out,
                source=projection.source.numpy(),
                target=projection.target.numpy(),
                weight=projection.weight.numpy(),
            )

    def encoding(self, task: EncodingTask, teacher: TeacherModel, calibration: Calibration) -> None:
        """Publishes the teacher's encoding fitted on `calibration`, unless another job published one
        first: then that one is kept, and every shard of this job encodes with it."""
        encoding, info = calibration.fit(
            teacher.lm_head(), teacher.transform, TORCH_DTYPES[self.hidden_dtype]
        )
        with self.writer.task(task.task_id, adopt=True) as out:
            write_encoding(out, encoding, info)
            out.num_rows, out.num_tokens = calibration.rows, calibration.tokens
        self._encodings.pop(task.teacher, None)

    def _encoding(self, teacher: int) -> Encoding | None:
        """The teacher's published encoding (None in an exact store), read from the store once."""
        plan = self.writer.plan
        if plan.storage.encoding == EXACT:
            return None
        if teacher not in self._encodings:
            task = next(t for t in plan.tasks if isinstance(t, EncodingTask) and t.teacher == teacher)
            part = load_part(self.writer.location, task.task_id)
            self._encodings[teacher] = read_encoding(self.writer.location, task.path, part)[0]
        return self._encodings[teacher]

    @contextmanager
    def shard(
        self, task: ShardTask, teacher: HiddenStateSource, rows: TokenizedRows, order: np.ndarray
    ) -> Iterator[AppendStates]:
        """The shard of `task`, its rows in processing `order`; published when the block exits without an
        error. A non-finite state refuses the whole task, naming the row."""
        dtype = TORCH_DTYPES[self.hidden_dtype]
        encoding = self._encoding(task.teacher)
        entry = next(t for t in self.writer.plan.teachers if t.index == task.teacher)
        own = entry.tokenizer is not None  # a teacher of another tokenizer: its own token rows
        with self.writer.task(task.task_id) as out:
            shard = HiddenShardWriter(
                out,
                row_ids=order,
                lengths=rows.token_rows(own)[1][order],
                hidden_size=teacher.hidden_size,
                dtype=self.hidden_dtype,
                encoding=encoding,
            )

            def append(batch: np.ndarray, hidden: list[torch.Tensor]) -> None:
                for row, states in zip(batch, hidden, strict=True):
                    if not torch.isfinite(states).all():
                        raise StoreIntegrityError(
                            f"teacher {task.teacher} ({teacher.checkpoint}) produced non-finite hidden "
                            f"states for row {row} (source key {rows.source_keys[row]}); nothing of the task "
                            "was written"
                        )
                    shard.append(int(row), states if encoding is not None else states.to(dtype))

            yield append
            shard.close()
            if own:
                columns = {name: [rows.cross[col][r] for r in order] for name, col in CROSS_ARRAYS.items()}
                trained = [rows.loss_mask[r] for r in order]
                write_alignment(
                    out, hidden_size=teacher.hidden_size, dtype=self.hidden_dtype, trained=trained, **columns
                )

    @property
    def removed(self) -> tuple[Path, ...]:
        """Temporaries of stopped jobs that opening the store removed."""
        return tuple(self.writer.removed)

    @property
    def published(self) -> bool:
        """Whether this job's finalize published the manifest (a racing job's may have won)."""
        return self.writer.published

    def finalize(self) -> Manifest | None:
        """The manifest, when every task of the store is done (by this job or others); else None."""
        return self.writer.finalize(
            created_by=f"mopd {__version__}",
            volatile={
                "finalized_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "host": platform.node(),
            },
        )


class NoOutput:
    """A megatron rank other than its group's writer: it runs every forward the writer runs (its stage
    and tensor-parallel slice of each) and writes nothing. The output layer and its capture check are the
    writer's."""

    writes = False
    published = False
    removed: tuple[Path, ...] = ()

    def done(self) -> set[str]:
        return set()  # the group's writer says which tasks are left

    def check_capture(self, teacher: TeacherModel, rows: Sequence[np.ndarray]) -> None:
        pass

    def rows(self, task: RowsTask, rows: TokenizedRows) -> None:
        pass

    def head(self, task: HeadTask, teacher: TeacherModel) -> None:
        pass

    def encoding(self, task: EncodingTask, teacher: TeacherModel, calibration: Calibration) -> None:
        pass

    def projection(self, task: ProjectionTask, projection: Projection) -> None:
        pass

    @contextmanager
    def shard(
        self, task: ShardTask, teacher: HiddenStateSource, rows: TokenizedRows, order: np.ndarray
    ) -> Iterator[AppendStates]:
        yield lambda batch, hidden: None

    def finalize(self) -> Manifest | None:
        return None


Output = StoreOutput | NoOutput
