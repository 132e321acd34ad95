"""The projection of a teacher's vocabulary onto the student's (mopd.tokens.projection)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mopd.base.errors import ConfigError
from mopd.tokens.pieces import END_OF_TURN, TokenTable
from mopd.tokens.projection import Projection, first_token_projection, load_projection
from tests.tokens.test_alignment import real_tokenizers


def test_the_real_pair_projects_every_token_it_can_and_rows_sum_to_one() -> None:
    """SmolLM2 (teacher) onto GPT-2 (student): every text token has an image whose bytes start its own,
    a token both vocabularies hold maps to the student's token of the same bytes, the end of a turn to
    the student's end of a turn."""
    gpt2, gpt2_table, smol, smol_table = real_tokenizers()
    projection = first_token_projection(smol_table, gpt2, gpt2_table)
    projection.check(teacher_vocab=len(smol), student_vocab=len(gpt2))
    assert (projection.weight == 1).all()
    images = dict(zip(projection.source.tolist(), projection.target.tolist(), strict=True))
    for j, piece in enumerate(smol_table.pieces):
        if piece is None:
            continue
        image = gpt2_table.pieces[images[j]]  # SmolLM2 holds every byte GPT-2 does: no text token lost
        assert image is not None and piece.startswith(image)
    shared = {p: k for k, p in enumerate(gpt2_table.pieces) if p is not None}
    same = [j for j, p in enumerate(smol_table.pieces) if p in shared]
    assert len(same) > 20_000 and all(gpt2_table.pieces[images[j]] == smol_table.pieces[j] for j in same)
    turn = {r: t for t, r in smol_table.roles.items()}[END_OF_TURN]
    assert images[turn] == {r: t for t, r in gpt2_table.roles.items()}[END_OF_TURN]
    # GPT-2 holds tokens no SmolLM2 token starts with: the divergence runs over those it reaches.
    assert 0.5 * len(gpt2) < int(projection.reached().sum()) < len(gpt2)


def test_a_permuted_vocabulary_projects_as_its_permutation() -> None:
    gpt2, gpt2_table, _, _ = real_tokenizers()
    perm = torch.randperm(len(gpt2_table), generator=torch.Generator().manual_seed(0))
    permuted = TokenTable(
        pieces=tuple(gpt2_table.pieces[int(k)] for k in perm),
        roles={int((perm == t).nonzero()[0, 0]): r for t, r in gpt2_table.roles.items()},
    )
    projection = first_token_projection(permuted, gpt2, gpt2_table)
    assert torch.equal(projection.source, torch.arange(len(gpt2_table)))
    assert torch.equal(projection.target, perm)  # teacher token j is student token perm[j]
    assert bool(projection.reached().all())


def small() -> Projection:
    return Projection(
        source=torch.tensor([0, 1, 1, 2]),
        target=torch.tensor([0, 0, 2, 1]),
        weight=torch.tensor([1.0, 0.25, 0.75, 1.0]),
        teacher_vocab=3,
        student_vocab=4,
    )


def test_projection_files_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    small().save(path)
    loaded = load_projection(path)
    assert loaded.fingerprint == small().fingerprint
    assert loaded.reached().tolist() == [True, True, True, False]
    for change, message in [
        ({"weight": torch.tensor([1.0, 0.5, 0.75, 1.0])}, "teacher token 1's weights sum to 1.25, not 1"),
        ({"target": torch.tensor([0, 0, 4, 1])}, "a target id is outside the student's 4 tokens"),
        ({"source": torch.tensor([0, 1, 1, 3])}, "a source id is outside the teacher's 3 tokens"),
        ({"weight": torch.tensor([1.0, -0.25, 1.25, 1.0])}, "weights must be finite and nonnegative"),
    ]:
        fields = {"source": small().source, "target": small().target, "weight": small().weight} | change
        Projection(**fields, teacher_vocab=3, student_vocab=4).save(path)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_projection(path)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="is not a projection file"):
        load_projection(path)
    with pytest.raises(ConfigError, match="maps onto 4 student tokens; the student has 5"):
        small().check(student_vocab=5)
    assert small().fingerprint != Projection(**{**small().__dict__, "student_vocab": 5}).fingerprint
