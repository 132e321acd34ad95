"""Rows for teachers of other tokenizers (DESIGN §13): each row routed to such a teacher is tokenised a
second time, by the teacher's own tokenizer (a chat row through its own chat template), and the two
tokenisations are aligned (`mopd.tokens.alignment`). The results travel beside the student's row as
extra columns of the ingested rows (`CROSS_COLUMNS`), empty for rows of the store's tokenizer.

Rows given as `input_ids` alone carry no text for a teacher to read, and are refused for such teachers;
rows that give their text beside the ids (`mopd rollout`'s: the student's samples, with `messages` or
`prompt` + `completion`) train the student on the ids and give the teacher the text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mopd.base.errors import ConfigError
from mopd.tokens.alignment import align_row
from mopd.tokens.pieces import TokenTable, token_table

# column → dtype of its values: the teacher's tokens and loss mask (its own positions), the aligned
# teacher position and span of each student position, the span of each teacher position.
CROSS_COLUMNS = {
    "teacher_ids": "int32",
    "teacher_mask": "uint8",
    "aligned": "int32",
    "student_span": "int32",
    "teacher_span": "int32",
}


@dataclass(frozen=True)
class CrossTokenizers:
    """The student's (the store's) token table, and each teacher of another tokenizer's tokenizer and
    table, by teacher index."""

    student_table: TokenTable
    teachers: dict[int, tuple[Any, TokenTable]]

    @classmethod
    def of(cls, student: Any, teachers: Mapping[int, Any]) -> CrossTokenizers:
        return cls(token_table(student), {t: (tok, token_table(tok)) for t, tok in teachers.items()})


def empty_columns() -> dict[str, np.ndarray]:
    """The cross columns of a row of the store's tokenizer."""
    return {name: np.zeros(0, dtype) for name, dtype in CROSS_COLUMNS.items()}


def cross_columns(
    student: tuple[np.ndarray, np.ndarray],
    teacher: tuple[np.ndarray, np.ndarray],
    *,
    table: TokenTable,
    cross: CrossTokenizers,
    limit: int,
) -> dict[str, np.ndarray]:
    """A row's cross columns from its two tokenisations (ids, loss mask), the teacher's cut to `limit`
    tokens as the student's is (its last kept position then trains nothing)."""
    ids, mask = teacher
    if ids.shape[0] > limit:
        ids, mask = ids[:limit], mask[:limit].copy()
        mask[-1] = 0
    alignment = align_row(
        student[0], student[1], ids, mask, student_table=cross.student_table, teacher_table=table
    )
    return {
        "teacher_ids": ids.astype(np.int32),
        "teacher_mask": mask.astype(np.uint8),
        "aligned": alignment.aligned,
        "student_span": alignment.student_span,
        "teacher_span": alignment.teacher_span,
    }


def refuse_given_ids(row: int, teacher: int) -> None:
    raise ConfigError(
        f"row {row} is routed to teacher {teacher}, whose tokenizer is not the store's, but gives "
        "input_ids alone: a teacher of another tokenizer reads the row's text; give rows as messages, "
        "prompt + completion or text (beside the ids, or instead of them)"
    )


def aligned_shares(table: pa.Table, other_tokenizer: np.ndarray) -> dict[int, tuple[float, float]]:
    """teacher → (share of its trained positions with an aligned teacher position, share with one or
    a span), for each teacher of another tokenizer, over the ingested rows `table` (`other_tokenizer`:
    each row's such teacher, `TokenizedRows.other_tokenizer`)."""
    if "aligned" not in table.column_names:  # a store of one tokenizer
        return {}
    aligned_lengths = pc.list_value_length(table.column("aligned")).to_numpy(zero_copy_only=False)
    own = aligned_lengths > 0  # rows of teachers of other tokenizers
    if not own.any():
        return {}
    rows = table.filter(pa.array(own))

    def flat(name: str) -> np.ndarray:
        return pc.list_flatten(rows.column(name)).to_numpy(zero_copy_only=False)

    teacher = np.repeat(other_tokenizer[own], aligned_lengths[own])
    trained = flat("loss_mask").astype(bool)
    aligned, spanned = flat("aligned") >= 0, flat("student_span") >= 0
    out = {}
    for t in np.unique(teacher[trained]).tolist():
        mine = trained & (teacher == t)
        count = int(mine.sum())
        out[int(t)] = (float(aligned[mine].sum()) / count, float((aligned | spanned)[mine].sum()) / count)
    return out
