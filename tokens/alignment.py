"""Which positions of two tokenisations of one text predict the same thing (DESIGN §13).

Each side's trained tokens are spelled as a stream of units: a text byte is a unit (0-255), a special
token one unit standing for its role. Student token i and teacher token j are *aligned* when they start
at the same unit of the common text: before them, each model has seen the same text in its own tokens,
and what comes next starts at the same byte on both sides. Where the two streams differ (a chat
template's own text around the completion, a completion cut off on one side), units are matched by the
longest common runs (difflib), and a token starting at an unmatched unit has no partner.

Between two consecutive aligned boundaries lies a *span*: the same bytes, tokenised as one run of
student tokens and one run of teacher tokens. A span's likelihood is comparable across vocabularies
(the span loss of `train/kernel/spans.py`), so positions that no aligned teacher position
can supervise still get a signal. A span counts only when its bytes are the same on both sides.

All functions here are pure: token ids and tables in, positions out, no tokenizer.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mopd.tokens.pieces import TokenTable

ROLE_UNITS = 1 << 8  # units at or past 256 are roles, one per distinct role of the pair of tables


@dataclass(frozen=True)
class Spelled:
    """A run of tokens spelled as units: `units` concatenated, `starts[i]` the unit token i starts at."""

    units: tuple[int, ...]
    starts: tuple[int, ...]


def spell(token_ids: Sequence[int], table: TokenTable, role_units: dict[str, int]) -> Spelled:
    """The units of `token_ids`; `role_units` (role → unit ≥ 256, shared by both sides, extended here
    with roles not seen before) numbers the special tokens' roles."""
    units: list[int] = []
    starts: list[int] = []
    for token in token_ids:
        starts.append(len(units))
        piece = table.pieces[token]
        if piece is None:
            role = table.roles[token]
            units.append(role_units.setdefault(role, ROLE_UNITS + len(role_units)))
        else:
            units.extend(piece)
    return Spelled(units=tuple(units), starts=tuple(starts))


@dataclass(frozen=True)
class Alignment:
    """`teacher_of[i]`: the teacher token aligned with student token i, or −1. `spans`: (student
    first, student stop, teacher first, teacher stop) token ranges of the same bytes, in order."""

    teacher_of: tuple[int, ...]
    spans: tuple[tuple[int, int, int, int], ...]

    @property
    def num_aligned(self) -> int:
        return sum(j >= 0 for j in self.teacher_of)


def _unit_map(student: Sequence[int], teacher: Sequence[int]) -> dict[int, int]:
    """student unit → teacher unit over the longest common runs of the two streams."""
    if student == teacher:  # the common case: the same text and specials on both sides
        return {u: u for u in range(len(student))}
    matcher = difflib.SequenceMatcher(None, student, teacher, autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


def align(student: Spelled, teacher: Spelled) -> Alignment:
    """Aligned token pairs and the spans between them (see the module's docstring)."""
    unit_map = _unit_map(student.units, teacher.units)
    teacher_at = {unit: j for j, unit in enumerate(teacher.starts)}
    # Tokens start at an end unit (one past the stream) only when empty, which no real token is.
    pairs = [
        (i, teacher_at[unit_map[unit]])
        for i, unit in enumerate(student.starts)
        if unit in unit_map and unit_map[unit] in teacher_at
    ]
    teacher_of = [-1] * len(student.starts)
    for i, j in pairs:
        teacher_of[i] = j
    # Each aligned pair closes the span before it; the stream ends close the last one when both end
    # there. A span holds only when every unit between its ends is matched, in order.
    ends = [*pairs, (len(student.starts), len(teacher.starts))]
    student_ends = [*student.starts, len(student.units)]
    teacher_ends = [*teacher.starts, len(teacher.units)]
    ends_match = (
        len(student.units) - 1 in unit_map and unit_map[len(student.units) - 1] == len(teacher.units) - 1
    )
    spans = []
    for (i0, j0), (i1, j1) in itertools.pairwise(ends):
        if (i1, j1) == ends[-1] and not ends_match:
            break
        a0, a1, b0, b1 = student_ends[i0], student_ends[i1], teacher_ends[j0], teacher_ends[j1]
        if a1 - a0 == b1 - b0 and all(unit_map.get(a0 + k) == b0 + k for k in range(a1 - a0)):
            spans.append((i0, i1, j0, j1))
    return Alignment(teacher_of=tuple(teacher_of), spans=tuple(spans))


@dataclass(frozen=True)
class RowAlignment:
    """One row's alignment by positions (position t predicts token t + 1, the loss-mask convention):
    `aligned[t]` the teacher position that predicts what student position t does, or −1;
    `student_span[t]` / `teacher_span[u]` the span (numbered from 0 within the row) whose bytes the
    position's next token starts, or −1. Only trained positions (loss mask 1) of either side take part."""

    aligned: np.ndarray  # [L_student] int32
    student_span: np.ndarray  # [L_student] int32
    teacher_span: np.ndarray  # [L_teacher] int32


def align_row(
    student_ids: np.ndarray,
    student_mask: np.ndarray,
    teacher_ids: np.ndarray,
    teacher_mask: np.ndarray,
    *,
    student_table: TokenTable,
    teacher_table: TokenTable,
) -> RowAlignment:
    """The alignment of one row's two tokenisations over their trained tokens (the tokens each side's
    trained positions predict, concatenated: the completion, or every assistant turn)."""
    student_pos = np.flatnonzero(student_mask)
    teacher_pos = np.flatnonzero(teacher_mask)
    roles: dict[str, int] = {}
    student = spell(student_ids[student_pos + 1].tolist(), student_table, roles)
    teacher = spell(teacher_ids[teacher_pos + 1].tolist(), teacher_table, roles)
    alignment = align(student, teacher)
    aligned = np.full(student_ids.shape[0], -1, np.int32)
    pairs = np.array([(i, j) for i, j in enumerate(alignment.teacher_of) if j >= 0], np.int64).reshape(-1, 2)
    aligned[student_pos[pairs[:, 0]]] = teacher_pos[pairs[:, 1]]
    student_span = np.full(student_ids.shape[0], -1, np.int32)
    teacher_span = np.full(teacher_ids.shape[0], -1, np.int32)
    for k, (i0, i1, j0, j1) in enumerate(alignment.spans):
        student_span[student_pos[i0:i1]] = k
        teacher_span[teacher_pos[j0:j1]] = k
    return RowAlignment(aligned=aligned, student_span=student_span, teacher_span=teacher_span)


def shares_line(name: str, aligned: float, reached: float) -> str:
    """How much of a teacher of another tokenizer's trained text it supervises, in the one line precompute
    and `mopd train` print."""
    return (
        f"teacher {name} (another tokenizer): {aligned:.1%} of its trained positions aligned with one of "
        f"its own, {reached:.1%} aligned or inside a span of the same text"
    )
