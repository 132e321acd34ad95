"""Packing rows into batches by a token budget and splitting tasks across jobs (pure functions).

Shared by precompute (teacher forward batches) and train (microbatches), so it lives in the neutral layer.
"""

from __future__ import annotations

import numpy as np


def pack_batches(row_ids: np.ndarray, lengths: np.ndarray, *, batch_tokens: int) -> list[np.ndarray]:
    """Groups rows into batches whose padded size (rows × longest row) stays within `batch_tokens`.

    Rows are sorted by length, longest first (so an out-of-memory shows in the first batch, and each
    batch pads little); ties keep row order. A row longer than the budget is a batch of its own.

    Args:
        row_ids: [R] the rows to pack.
        lengths: [R] their token counts.
    Returns:
        Batches of row ids; every row appears in exactly one.
    """
    if batch_tokens <= 0:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    order = np.lexsort((row_ids, -lengths))
    batches: list[np.ndarray] = []
    current: list[int] = []
    longest = 0
    for k in order:
        length = int(lengths[k])
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, longest = [], 0
        current.append(int(row_ids[k]))
        longest = max(longest, length)
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return batches


def select_tasks(task_ids: list[str], *, num_tasks: int, task_index: int) -> list[str]:
    """The tasks job `task_index` of `num_tasks` runs: every num_tasks-th task, starting at task_index."""
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise ValueError(
            f"--task-index must be in [0, {num_tasks}) and --num-tasks ≥ 1 (got {task_index} of {num_tasks})"
        )
    return task_ids[task_index::num_tasks]
