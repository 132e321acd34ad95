"""Acceptance: teacher numbering depends on the set of checkpoints only."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from mopd.store.format.teachers import TeacherIdentity, assign_teacher_indices, diff_teacher_lists

CHECKPOINTS = [f"/ckpts/{name}" for name in ("qwen-math", "llama-code", "chat", "a", "zz", "m/x")]
aliases = st.text(alphabet="abcdefghij_", min_size=1, max_size=8)


def index_list(teachers: dict[str, str]) -> list[tuple[int, str]]:
    return [(s.index, s.checkpoint) for s in assign_teacher_indices(teachers)]


@settings(max_examples=300, deadline=None)
@given(
    mapping=st.dictionaries(aliases, st.sampled_from(CHECKPOINTS), min_size=1, max_size=8),
    seed=st.integers(0, 2**32),
    renames=st.lists(aliases, min_size=8, max_size=8, unique=True),
)
def test_reorder_rename_and_extra_aliases_keep_numbering(
    mapping: dict[str, str], seed: int, renames: list[str]
) -> None:
    expected = index_list(mapping)
    items = list(mapping.items())
    random.Random(seed).shuffle(items)
    assert index_list(dict(items)) == expected  # reordered
    renamed = {new: ckpt for new, (_, ckpt) in zip(renames, items, strict=False)}
    if len(renamed) == len(items):
        assert index_list(renamed) == expected  # renamed
    existing = items[seed % len(items)][1]
    assert index_list({**mapping, "another_alias_x": existing}) == expected  # alias added to a checkpoint
    assert [i for i, _ in expected] == list(range(len(set(mapping.values()))))


@settings(max_examples=200, deadline=None)
@given(
    first=st.sets(st.sampled_from(CHECKPOINTS), min_size=1),
    second=st.sets(st.sampled_from(CHECKPOINTS), min_size=1),
)
def test_different_checkpoint_sets_are_told_apart(first: set[str], second: set[str]) -> None:
    a = index_list({f"alias{i}": c for i, c in enumerate(sorted(first))})
    b = index_list({f"other{i}": c for i, c in enumerate(sorted(second))})
    assert (a == b) == (first == second)
    ids_a = [TeacherIdentity(i, c) for i, c in a]
    ids_b = [TeacherIdentity(i, c) for i, c in b]
    assert (diff_teacher_lists(ids_a, ids_b) == []) == (first == second)


def test_aliases_of_one_checkpoint_share_an_index(tmp_path: Path) -> None:
    (tmp_path / "math").mkdir()
    (tmp_path / "code").mkdir()
    slots = assign_teacher_indices(
        {
            "math": str(tmp_path / "math"),
            "code": str(tmp_path / "code"),
            "chat": str(tmp_path / "math" / ".." / "math"),
        }
    )
    assert [(s.index, Path(s.checkpoint).name, s.aliases) for s in slots] == [
        (0, "code", ("code",)),
        (1, "math", ("chat", "math")),
    ]


def test_moved_checkpoint_with_same_fingerprint_is_same_teacher() -> None:
    store = [TeacherIdentity(0, "/old/a", "fa"), TeacherIdentity(1, "/old/b", "fb")]
    moved = [TeacherIdentity(0, "/new/a", "fa"), TeacherIdentity(1, "/new/b", "fb")]
    assert diff_teacher_lists(store, moved) == []
    changed = [TeacherIdentity(0, "/old/a", "fa"), TeacherIdentity(1, "/old/b", "fc")]
    (problem,) = diff_teacher_lists(store, changed)
    assert "fingerprint changed at the same path" in problem and "/old/b" in problem
