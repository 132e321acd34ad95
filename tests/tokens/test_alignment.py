"""Alignment of two tokenisations of one text (mopd.tokens.alignment): hand-written pairs with the
aligned positions and spans written out, and a property test over random texts and two real tokenizers
(SmolLM2's and GPT-2's byte-level BPEs)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopd.tokens.alignment import Alignment, Spelled, align, spell
from mopd.tokens.pieces import END_OF_TEXT, END_OF_TURN, TokenTable, token_table

EOT, EOS = 100, 101  # special token ids of the hand-written tables


def table(*pieces: bytes) -> TokenTable:
    """A table whose ids 0.. spell `pieces`, with an end-of-turn (100) and an end-of-text (101) token."""
    spelled: list[bytes | None] = [*pieces] + [b"\x00"] * (EOT - len(pieces)) + [None, None]
    return TokenTable(pieces=tuple(spelled), roles={EOT: END_OF_TURN, EOS: END_OF_TEXT})


def aligned(student: list[bytes | int], teacher: list[bytes | int]) -> Alignment:
    """Tokens given as their bytes (or a special's id), each side's ids numbered in order."""

    def tokens(side: list[bytes | int]) -> tuple[TokenTable, list[int]]:
        pieces = [t for t in side if isinstance(t, bytes)]
        ids, k = [], 0
        for t in side:
            ids.append(t if isinstance(t, int) else k)
            k += isinstance(t, bytes)
        return table(*pieces), ids

    roles: dict[str, int] = {}
    (s_table, s_ids), (t_table, t_ids) = tokens(student), tokens(teacher)
    return align(spell(s_ids, s_table, roles), spell(t_ids, t_table, roles))


def test_shared_boundaries_align_every_token() -> None:
    got = aligned([b"ab", b"c", b"d"], [b"ab", b"c", b"d"])
    assert got.teacher_of == (0, 1, 2)
    assert got.spans == ((0, 1, 0, 1), (1, 2, 1, 2), (2, 3, 2, 3))


def test_a_merge_on_the_student_side() -> None:
    got = aligned([b"abc", b"d"], [b"a", b"bc", b"d"])
    assert got.teacher_of == (0, 2)
    assert got.spans == ((0, 1, 0, 2), (1, 2, 2, 3))


def test_a_merge_on_the_teacher_side() -> None:
    got = aligned([b"a", b"b", b"cd"], [b"ab", b"cd"])
    assert got.teacher_of == (0, -1, 1)
    assert got.spans == ((0, 2, 0, 1), (2, 3, 1, 2))


def test_multi_byte_utf8_split_differently() -> None:
    e_acute = "é".encode()  # c3 a9
    got = aligned([e_acute[:1], e_acute[1:], b"x"], [e_acute, b"x"])
    assert got.teacher_of == (0, -1, 1)  # the student's second byte starts at no teacher boundary
    assert got.spans == ((0, 2, 0, 1), (2, 3, 1, 2))
    # Both split the character at its second byte: that boundary is aligned too.
    got = aligned([e_acute[:1], e_acute[1:] + b"x"], [e_acute[:1], e_acute[1:], b"x"])
    assert got.teacher_of == (0, 1)
    assert got.spans == ((0, 1, 0, 1), (1, 2, 1, 3))


def test_special_tokens_map_by_role() -> None:
    got = aligned([b"hi", EOT], [b"h", b"i", EOT])
    assert got.teacher_of == (0, 2)
    assert got.spans == ((0, 1, 0, 2), (1, 2, 2, 3))
    # An end of text is not an end of turn: the student's special has no partner, nor a span.
    got = aligned([b"hi", EOT], [b"h", b"i", EOS])
    assert got.teacher_of == (0, -1)
    assert got.spans == ()  # the last span would hold different units; the streams end differently


def test_a_completion_that_ends_mid_token_on_one_side() -> None:
    # The teacher's row was cut after "abc": its last token starts where the student's does, so that
    # position is aligned, but the bytes after it are not the same on both sides: no span closes.
    got = aligned([b"ab", b"cd"], [b"ab", b"c"])
    assert got.teacher_of == (0, 1)
    assert got.spans == ((0, 1, 0, 1),)


def test_template_text_that_differs_is_skipped() -> None:
    # Each side's own text before the completion ("x:" and "y:"): matched runs align what follows.
    got = aligned([b"x:", b" hi", EOT], [b"y:", b" h", b"i", EOT])
    assert got.teacher_of == (-1, 1, 3)
    assert got.spans == ((1, 2, 1, 3), (2, 3, 3, 4))


@functools.cache
def real_tokenizers() -> tuple[Any, TokenTable, Any, TokenTable]:
    from transformers import AutoTokenizer

    from mopd.precompute.packaged_models import gpt2_tokenizer, smollm2_checkpoint

    gpt2 = AutoTokenizer.from_pretrained(gpt2_tokenizer())
    smol = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    return gpt2, token_table(gpt2), smol, token_table(smol)


# Words, digits, spaces, newlines and multi-byte characters (2, 3 and 4 bytes of UTF-8): where two
# byte-level BPEs merge differently.
PIECES = [*"ab cde\n\t0123456789.,!?'-_()é日本語ß€🙂", "th", "ing", " the", "   ", " 12345", "tion"]
TEXTS = st.lists(st.sampled_from(PIECES), min_size=1, max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_real_tokenizers_align_every_shared_boundary_and_nothing_else(text: str) -> None:
    gpt2, gpt2_table, smol, smol_table = real_tokenizers()
    roles: dict[str, int] = {}
    student: Spelled = spell(gpt2(text, add_special_tokens=False)["input_ids"], gpt2_table, roles)
    teacher: Spelled = spell(smol(text, add_special_tokens=False)["input_ids"], smol_table, roles)
    assert bytes(student.units) == bytes(teacher.units) == text.encode()  # the tables spell the text
    got = align(student, teacher)
    teacher_starts = set(teacher.starts)
    for i, j in enumerate(got.teacher_of):
        if j >= 0:
            assert student.starts[i] == teacher.starts[j]  # an aligned pair starts at the same byte
        else:
            assert student.starts[i] not in teacher_starts  # no shared boundary is missed
    ends = [*student.starts, len(student.units)], [*teacher.starts, len(teacher.units)]
    covered = 0
    for i0, i1, j0, j1 in got.spans:  # every span holds the same bytes on both sides, in order
        assert (ends[0][i0], ends[0][i1]) == (ends[1][j0], ends[1][j1])
        assert got.teacher_of[i0] == j0
        assert i0 == covered
        covered = i1
    assert covered == len(student.starts)  # one text on both sides: the spans cover every token


def test_a_row_is_aligned_by_positions_over_its_trained_tokens() -> None:
    """Position t predicts token t + 1; only trained positions take part. Student: prompt "P" then the
    trained "ab", "c", end of turn; teacher: its own prompt "QQ" then "a", "bc", end of turn."""
    from mopd.tokens.alignment import align_row

    student = table(b"P", b"ab", b"c")
    teacher = table(b"Q", b"a", b"bc")
    student_ids, student_mask = np.array([0, 1, 2, EOT]), np.array([1, 1, 1, 0])  # predicts ab, c, EOT
    teacher_ids, teacher_mask = np.array([0, 0, 1, 2, EOT]), np.array([0, 1, 1, 1, 0])  # a, bc, EOT
    got = align_row(
        student_ids, student_mask, teacher_ids, teacher_mask, student_table=student, teacher_table=teacher
    )
    assert got.aligned.tolist() == [1, -1, 3, -1]  # "ab"/"a" start together; "c" starts inside "bc"
    assert got.student_span.tolist() == [0, 0, 1, -1]
    assert got.teacher_span.tolist() == [-1, 0, 0, 1, -1]
