"""The store's layout: the pure task plan, and what each kind of task writes (its arrays, their logical
dtypes and shapes). Writer, reader, finalize and verify all read these declarations; no array name is
spelt anywhere else.

    rows/                      input_ids [T] int32, loss_mask [T] uint8, offsets [R+1] int64,
                               teacher_index [R] int16, source_key [R] string
                               (a store whose rows may have several teachers: teacher_set [R] int64,
                               bit t set where teacher t scores the row; teacher_index its lowest)
    teachers/{t}/lm_head       [V, H] (the folder is the array)
    teachers/{t}/shards/shard_{s:06d}/
                               hidden [T_s, H], offsets [R_s+1] int64, row_ids [R_s] int64
                               (int8-rotated: codes [T_s, H] int8 and scales [T_s] float32 for hidden)
                               a teacher of another tokenizer (T_s its own tokens, A_s the rows'
                               student positions): token_ids [T_s] int32, teacher_span [T_s] int32,
                               aligned [A_s] int32, student_span [A_s] int32
    teachers/{t}/encoding      int8-rotated only: mean [H] float32, signs [H] int8, mix [m, m] float32,
                               calibration.json
    teachers/{t}/projection    a teacher of another tokenizer: source [E] int64, target [E] int64,
                               weight [E] float32 (`mopd.tokens.projection.Projection`'s entries)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from mopd.store.format.manifest import (
    EXACT,
    ArtifactRecord,
    EncodingArtifact,
    EncodingTask,
    HeadArtifact,
    HeadTask,
    Manifest,
    ProjectionArtifact,
    ProjectionTask,
    RowsArtifact,
    RowsTask,
    ShardArtifact,
    ShardTask,
    TaskSpec,
)

ROWS_PATH = "rows"
ROWS_TASK_ID = "rows"

INPUT_IDS, LOSS_MASK, OFFSETS, TEACHER_INDEX, SOURCE_KEY = (
    "input_ids",
    "loss_mask",
    "offsets",
    "teacher_index",
    "source_key",
)
TEACHER_SET = "teacher_set"
HIDDEN, ROW_IDS = "hidden", "row_ids"
TOKEN_IDS, ALIGNED, STUDENT_SPAN, TEACHER_SPAN = "token_ids", "aligned", "student_span", "teacher_span"
CODES, SCALES = "codes", "scales"
MEAN, SIGNS, MIX = "mean", "signs", "mix"
SOURCE, TARGET, WEIGHT = "source", "target", "weight"
HEAD = ""  # an LM-head task's folder is itself the array


@dataclass(frozen=True)
class ArraySpec:
    """One array a task writes: its name in the task folder, logical dtype and shape."""

    name: str
    dtype: str  # a numpy dtype name, "bfloat16", or "string" (variable-length UTF-8)
    shape: tuple[int, ...]


def rows_arrays(num_rows: int, num_tokens: int, teacher_sets: bool = False) -> dict[str, ArraySpec]:
    """The rows task's arrays. `loss_mask[t] = 1`: the prediction made at position t (of token t+1) trains."""
    arrays = {
        INPUT_IDS: ArraySpec(INPUT_IDS, "int32", (num_tokens,)),
        LOSS_MASK: ArraySpec(LOSS_MASK, "uint8", (num_tokens,)),
        OFFSETS: ArraySpec(OFFSETS, "int64", (num_rows + 1,)),
        TEACHER_INDEX: ArraySpec(TEACHER_INDEX, "int16", (num_rows,)),
        SOURCE_KEY: ArraySpec(SOURCE_KEY, "string", (num_rows,)),
    }
    if teacher_sets:
        arrays[TEACHER_SET] = ArraySpec(TEACHER_SET, "int64", (num_rows,))
    return arrays


# A row's teachers as a set: bit t of an int64 for teacher t, so a row may name teachers 0 … 62.
MAX_SET_TEACHER = 62


def set_mask(teachers: Collection[int]) -> int:
    """The bits of a set of teacher indices (each ≤ MAX_SET_TEACHER)."""
    return sum(1 << t for t in set(teachers))


def set_members(mask: int) -> tuple[int, ...]:
    """The teacher indices of a set's bits, ascending."""
    return tuple(t for t in range(MAX_SET_TEACHER + 1) if mask >> t & 1)


def scored_by(teacher_index: np.ndarray, teacher_set: np.ndarray | None, teacher: int) -> np.ndarray:
    """[R] bool: the rows teacher `teacher` scores (its own, or those whose set names it)."""
    if teacher_set is None:
        return teacher_index == teacher
    return (teacher_set >> teacher) & 1 == 1


def head_array(vocab_size: int, hidden_size: int, dtype: str) -> ArraySpec:
    """A teacher's LM head [V, H], chunked along V so a tensor-parallel rank reads only its slice."""
    return ArraySpec(HEAD, dtype, (vocab_size, hidden_size))


def shard_arrays(
    num_rows: int,
    num_tokens: int,
    hidden_size: int,
    dtype: str,
    encoding: str = EXACT,
    *,
    aligned_tokens: int | None = None,
) -> dict[str, ArraySpec]:
    """A hidden-state shard: its rows' states packed end to end (exact, or codes and a scale a token),
    where each row starts, which rows. A teacher of another tokenizer's shard (`aligned_tokens`: its
    rows' student positions, end to end in row_ids order) adds the teacher's own tokens and the
    alignment (`mopd.tokens.alignment.RowAlignment`): the teacher position aligned with each student
    position, and each position's span, −1 for none."""
    if encoding == EXACT:
        states = {HIDDEN: ArraySpec(HIDDEN, dtype, (num_tokens, hidden_size))}
    else:
        states = {
            CODES: ArraySpec(CODES, "int8", (num_tokens, hidden_size)),
            SCALES: ArraySpec(SCALES, "float32", (num_tokens,)),
        }
    cross = {}
    if aligned_tokens is not None:
        cross = {
            TOKEN_IDS: ArraySpec(TOKEN_IDS, "int32", (num_tokens,)),
            TEACHER_SPAN: ArraySpec(TEACHER_SPAN, "int32", (num_tokens,)),
            ALIGNED: ArraySpec(ALIGNED, "int32", (aligned_tokens,)),
            STUDENT_SPAN: ArraySpec(STUDENT_SPAN, "int32", (aligned_tokens,)),
        }
    return {
        **states,
        OFFSETS: ArraySpec(OFFSETS, "int64", (num_rows + 1,)),
        ROW_IDS: ArraySpec(ROW_IDS, "int64", (num_rows,)),
        **cross,
    }


def factors(hidden_size: int) -> tuple[int, int, int]:
    """(m, a, b): H = m · a · b with m odd and a ≤ b powers of two, b ≤ 2a: the factors of an int8-rotated
    teacher's rotation (`codec.int8_rotated.Encoding`), Q [m, m] and the Hadamard matrices of orders a
    and b."""
    m = hidden_size
    while m % 2 == 0:
        m //= 2
    k = (hidden_size // m).bit_length() - 1
    return m, 1 << (k // 2), 1 << (k - k // 2)


def encoding_arrays(hidden_size: int) -> dict[str, ArraySpec]:
    """An int8-rotated teacher's encoding (`codec.int8_rotated.Encoding`): its mean, and its rotation's
    signs and Q."""
    m, _, _ = factors(hidden_size)
    return {
        MEAN: ArraySpec(MEAN, "float32", (hidden_size,)),
        SIGNS: ArraySpec(SIGNS, "int8", (hidden_size,)),
        MIX: ArraySpec(MIX, "float32", (m, m)),
    }


def projection_arrays(num_entries: int) -> dict[str, ArraySpec]:
    """A teacher's projection onto the store's vocabulary: entry e gives `weight[e]` of teacher token
    `source[e]`'s probability to store token `target[e]`."""
    return {
        SOURCE: ArraySpec(SOURCE, "int64", (num_entries,)),
        TARGET: ArraySpec(TARGET, "int64", (num_entries,)),
        WEIGHT: ArraySpec(WEIGHT, "float32", (num_entries,)),
    }


def artifact_arrays(artifact: ArtifactRecord, manifest: Manifest) -> list[ArraySpec]:
    """Every array a published task holds, with the shape the manifest implies."""
    if isinstance(artifact, RowsArtifact):
        dataset = manifest.dataset
        return list(rows_arrays(dataset.num_rows, dataset.num_tokens, dataset.teacher_sets).values())
    teacher = next(t for t in manifest.teachers if t.index == artifact.teacher)
    if isinstance(artifact, HeadArtifact):
        return [head_array(teacher.vocab_size, teacher.hidden_size, teacher.dtype)]
    if isinstance(artifact, EncodingArtifact):
        return list(encoding_arrays(teacher.hidden_size).values())
    if isinstance(artifact, ProjectionArtifact):
        return list(projection_arrays(artifact.tokens).values())
    assert isinstance(artifact, ShardArtifact)
    storage = manifest.storage
    arrays = shard_arrays(
        artifact.rows,
        artifact.tokens,
        teacher.hidden_size,
        storage.hidden_dtype,
        storage.encoding,
        aligned_tokens=artifact.aligned_tokens if teacher.tokenizer is not None else None,
    )
    return list(arrays.values())


def lm_head_path(teacher: int) -> str:
    return f"teachers/{teacher}/lm_head"


def shard_path(teacher: int, shard: int) -> str:
    return f"teachers/{teacher}/shards/shard_{shard:06d}"


def encoding_path(teacher: int) -> str:
    return f"teachers/{teacher}/encoding"


def projection_path(teacher: int) -> str:
    return f"teachers/{teacher}/projection"


def plan_tasks(
    teacher_index: np.ndarray,
    *,
    num_teachers: int,
    rows_per_task: int,
    encoding: str = EXACT,
    cross: Collection[int] = (),
    teacher_set: np.ndarray | None = None,
) -> list[TaskSpec]:
    """The deterministic task list: the rows, one LM head per teacher (and its projection, for a
    teacher of another tokenizer: `cross`), and hidden-state shards (in an int8-rotated store, each
    teacher's encoding before its shards).

    Teacher i's rows (in row order: those routed to it, or with `teacher_set` those whose set names it)
    are cut into blocks of `rows_per_task`; block s is shard s and covers the global row range from its
    first row to one past its last. A teacher with no rows has no shard, nor an encoding. A pure function
    of (the teachers of each row, teacher count, block size, encoding).
    """
    if rows_per_task <= 0:
        raise ValueError(f"rows_per_task must be positive, got {rows_per_task}")
    tasks: list[TaskSpec] = [
        RowsTask(task_id=ROWS_TASK_ID, path=ROWS_PATH, row_stop=int(teacher_index.shape[0]))
    ]
    for teacher in range(num_teachers):
        tasks.append(
            HeadTask(task_id=f"teacher_{teacher:03d}_lm_head", path=lm_head_path(teacher), teacher=teacher)
        )
        if teacher in cross:
            tasks.append(
                ProjectionTask(
                    task_id=f"teacher_{teacher:03d}_projection",
                    path=projection_path(teacher),
                    teacher=teacher,
                )
            )
        rows = np.flatnonzero(scored_by(teacher_index, teacher_set, teacher))
        if encoding != EXACT and rows.shape[0]:
            tasks.append(
                EncodingTask(
                    task_id=f"teacher_{teacher:03d}_encoding", path=encoding_path(teacher), teacher=teacher
                )
            )
        for shard, start in enumerate(range(0, rows.shape[0], rows_per_task)):
            block = rows[start : start + rows_per_task]
            tasks.append(
                ShardTask(
                    task_id=f"teacher_{teacher:03d}_shard_{shard:06d}",
                    path=shard_path(teacher, shard),
                    teacher=teacher,
                    shard=shard,
                    row_start=int(block[0]),
                    row_stop=int(block[-1]) + 1,
                )
            )
    return tasks


def shard_rows(
    teacher_index: np.ndarray, task: ShardTask, teacher_set: np.ndarray | None = None
) -> np.ndarray:
    """Global ids of the rows a shard task stores, in row order."""
    window = slice(task.row_start, task.row_stop)
    sets = None if teacher_set is None else teacher_set[window]
    return np.flatnonzero(scored_by(teacher_index[window], sets, task.teacher)) + task.row_start
