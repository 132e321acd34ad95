"""Names inside a store and the pure task plan: one place for every path the writer and readers use."""

from __future__ import annotations

import numpy as np

from mopd.store.manifest import TaskSpec

ROWS_PATH = "rows"
ROWS_TASK_ID = "rows"


def lm_head_path(teacher: int) -> str:
    return f"teachers/{teacher}/lm_head"


def shard_path(teacher: int, shard: int) -> str:
    return f"teachers/{teacher}/shards/shard_{shard:06d}"


def plan_tasks(teacher_index: np.ndarray, *, num_teachers: int, rows_per_task: int) -> list[TaskSpec]:
    """The deterministic task list: the rows, one LM head per teacher, and hidden-state shards.

    Teacher i's rows (in row order) are cut into blocks of `rows_per_task`; block s is shard s and
    covers the global row range from its first row to one past its last. A teacher with no rows has no
    shard. A pure function of (teacher index per row, teacher count, block size).
    """
    if rows_per_task <= 0:
        raise ValueError(f"rows_per_task must be positive, got {rows_per_task}")
    tasks = [
        TaskSpec(
            task_id=ROWS_TASK_ID,
            kind="rows",
            path=ROWS_PATH,
            row_start=0,
            row_stop=int(teacher_index.shape[0]),
        )
    ]
    for teacher in range(num_teachers):
        tasks.append(
            TaskSpec(
                task_id=f"teacher_{teacher:03d}_lm_head",
                kind="lm_head",
                path=lm_head_path(teacher),
                teacher=teacher,
            )
        )
        rows = np.flatnonzero(teacher_index == teacher)
        for shard, start in enumerate(range(0, rows.shape[0], rows_per_task)):
            block = rows[start : start + rows_per_task]
            tasks.append(
                TaskSpec(
                    task_id=f"teacher_{teacher:03d}_shard_{shard:06d}",
                    kind="hidden",
                    path=shard_path(teacher, shard),
                    teacher=teacher,
                    shard=shard,
                    row_start=int(block[0]),
                    row_stop=int(block[-1]) + 1,
                )
            )
    return tasks


def shard_rows(teacher_index: np.ndarray, task: TaskSpec) -> np.ndarray:
    """Global ids of the rows a hidden task stores, in row order."""
    window = teacher_index[task.row_start : task.row_stop]
    return np.flatnonzero(window == task.teacher) + task.row_start
