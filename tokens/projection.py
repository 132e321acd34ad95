"""The projection of a teacher's vocabulary onto the student's (DESIGN §13).

A projection is a sparse [V_teacher → V_student] matrix of nonnegative weights whose rows sum to 1: the
student's probability of token k is Σ_j p_teacher(j) · P[j, k]. mopd builds one per pair of tokenizers:
each teacher token's bytes, tokenised by the student, give all their mass to the student's first token
(`first_token_projection`); a special token goes to the student's special of the same role. A
projection file in the same form (`train.cross_tokenizer.projection`: safetensors `source`, `target`,
`weight`) replaces it where a learned or hand-tuned one does better.

What is lost: a teacher token the student would spell in several tokens gives its mass to the first of
them only, and a student token no teacher token starts with gets none (the divergence then runs over the
student tokens that some teacher token reaches; train/kernel/projected.py). A teacher token with no image
(a special with no student role, a byte no student token starts with) has its mass dropped, and the
divergence renormalises what is left.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mopd.base.errors import ConfigError
from mopd.tokens.pieces import TokenTable

ENTRY_ARRAYS = ("source", "target", "weight")


@dataclass(frozen=True)
class Projection:
    """Entries e of P: teacher token `source[e]` gives `weight[e]` of its mass to student token
    `target[e]` (int64, int64, float32; sorted by source)."""

    source: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor
    teacher_vocab: int
    student_vocab: int

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.teacher_vocab},{self.student_vocab};".encode())
        for name in ENTRY_ARRAYS:
            digest.update(getattr(self, name).contiguous().numpy().tobytes())
        return digest.hexdigest()

    def reached(self) -> torch.Tensor:
        """[V_student] bool: the student tokens some teacher token gives mass to."""
        out = torch.zeros(self.student_vocab, dtype=torch.bool)
        out[self.target[self.weight > 0]] = True
        return out

    def check(
        self, *, teacher_vocab: int | None = None, student_vocab: int | None = None, origin: str = ""
    ) -> None:
        """Refuses entries out of range, negative weights, rows not summing to 1 and mismatched sizes.

        Raises:
            ConfigError: naming `origin` and the first problem.
        """
        where = f"projection {origin}".strip()
        if teacher_vocab is not None and teacher_vocab != self.teacher_vocab:
            raise ConfigError(
                f"{where} maps {self.teacher_vocab} teacher tokens; the teacher has {teacher_vocab}"
            )
        if student_vocab is not None and student_vocab != self.student_vocab:
            raise ConfigError(
                f"{where} maps onto {self.student_vocab} student tokens; the student has {student_vocab}"
            )
        n = self.source.shape[0]
        if not (self.target.shape == self.weight.shape == (n,)):
            raise ConfigError(f"{where}: source, target and weight must have one length")
        if n and (int(self.source.min()) < 0 or int(self.source.max()) >= self.teacher_vocab):
            raise ConfigError(f"{where}: a source id is outside the teacher's {self.teacher_vocab} tokens")
        if n and (int(self.target.min()) < 0 or int(self.target.max()) >= self.student_vocab):
            raise ConfigError(f"{where}: a target id is outside the student's {self.student_vocab} tokens")
        if n and (not torch.isfinite(self.weight).all() or float(self.weight.min()) < 0):
            raise ConfigError(f"{where}: weights must be finite and nonnegative")
        sums = torch.zeros(self.teacher_vocab, dtype=torch.float64).index_add_(
            0, self.source, self.weight.double()
        )
        mapped = torch.zeros(self.teacher_vocab, dtype=torch.bool)
        mapped[self.source] = True
        # Each row's weights are fp32 numbers summing to 1 in exact arithmetic: a sum within a few ulps.
        bad = mapped & ((sums - 1).abs() > 1e-6)
        if bool(bad.any()):
            token = int(bad.nonzero()[0, 0])
            raise ConfigError(
                f"{where}: teacher token {token}'s weights sum to {float(sums[token]):.6g}, not 1"
            )

    def save(self, path: str | Path, *, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"teacher_vocab": str(self.teacher_vocab), "student_vocab": str(self.student_vocab)}
        save_file(
            {n: getattr(self, n).contiguous() for n in ENTRY_ARRAYS},
            str(path),
            metadata=meta | (metadata or {}),
        )


def load_projection(path: str | Path) -> Projection:
    """A projection file (safetensors: int64 `source`, `target`, float32 `weight`; metadata
    `teacher_vocab`, `student_vocab`).

    Raises:
        ConfigError: the file is missing or not of that form.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in ENTRY_ARRAYS}
        sizes = int(meta["teacher_vocab"]), int(meta["student_vocab"])
    except (OSError, KeyError, ValueError, Exception) as err:  # safetensors raises its own error types
        raise ConfigError(
            f"train.cross_tokenizer.projection: {path} is not a projection file (safetensors with "
            f"int64 source, target, float32 weight and teacher_vocab/student_vocab metadata): {err}"
        ) from err
    projection = Projection(
        source=arrays["source"].long(),
        target=arrays["target"].long(),
        weight=arrays["weight"].float(),
        teacher_vocab=sizes[0],
        student_vocab=sizes[1],
    )
    projection.check(origin=str(path))
    return projection


def _first_tokens(pieces: Sequence[bytes], student: Any, student_table: TokenTable) -> list[int | None]:
    """The student's first token of each piece: the student's token of exactly those bytes where it
    has one; else the student tokenizer's own first token where the piece is text and that token spells
    a prefix of it, else the longest student token that does (a piece
    that is part of a UTF-8 character is no text for a tokenizer to read); None where no student token
    spells a prefix (a byte the student's vocabulary never holds alone)."""
    by_bytes: dict[bytes, int] = {}
    for token_id, piece in enumerate(student_table.pieces):
        if piece is not None:
            by_bytes.setdefault(piece, token_id)
    longest = max(map(len, by_bytes))
    texts, where = [], []
    for k, piece in enumerate(pieces):
        try:
            texts.append(piece.decode("utf-8"))
            where.append(k)
        except UnicodeDecodeError:
            pass
    encoded = student(texts, add_special_tokens=False)["input_ids"] if texts else []
    firsts: list[int | None] = [None] * len(pieces)
    for k, ids in zip(where, encoded, strict=True):
        first = student_table.pieces[ids[0]] if ids else None
        if first is not None and pieces[k].startswith(first):
            firsts[k] = int(ids[0])
    out: list[int | None] = []
    for piece, first in zip(pieces, firsts, strict=True):
        if piece in by_bytes:  # the student's own token of these very bytes: a shared token maps to itself
            first = by_bytes[piece]
        elif first is None:
            size = min(len(piece), longest)
            while size and piece[:size] not in by_bytes:
                size -= 1
            first = by_bytes[piece[:size]] if size else None
        out.append(first)
    return out


def first_token_projection(
    teacher_table: TokenTable, student: Any, student_table: TokenTable, *, teacher_vocab: int | None = None
) -> Projection:
    """mopd's projection of a pair of tokenizers: each teacher token's mass to the student's first token
    of its bytes; each special to the student's special of its role (none: no entry).

    Args:
        teacher_table, student_table: the two tokenizers' tables (`pieces.token_table`).
        student: the student's tokenizer, which tokenises each teacher token's bytes.
        teacher_vocab: the teacher's vocabulary size, if more than its tokenizer's tokens (rows past the
            tokenizer map nowhere).
    """
    text_ids = [j for j, piece in enumerate(teacher_table.pieces) if piece is not None]
    firsts = _first_tokens([teacher_table.pieces[j] for j in text_ids], student, student_table)
    pairs = {j: first for j, first in zip(text_ids, firsts, strict=True) if first is not None}
    student_roles = student_table.role_ids()
    for token, role in teacher_table.roles.items():
        if role in student_roles:
            pairs[token] = student_roles[role]
    source = torch.tensor(sorted(pairs), dtype=torch.long)
    return Projection(
        source=source,
        target=torch.tensor([pairs[j] for j in source.tolist()], dtype=torch.long),
        weight=torch.ones(source.shape[0], dtype=torch.float32),
        teacher_vocab=teacher_vocab or len(teacher_table),
        student_vocab=len(student_table),
    )
