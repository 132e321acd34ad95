"""What `mopd inspect` shows: per-teacher rows, tokens and bytes of a finalized store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mopd.store.arrays import storage_dtype
from mopd.store.manifest import read_manifest


@dataclass(frozen=True)
class TeacherSummary:
    index: int
    aliases: list[str]
    checkpoint: str
    fingerprint: str
    hidden_size: int
    vocab_size: int
    rows: int
    tokens: int
    stored_bytes: int
    logical_bytes: int
    full_logit_bytes: int  # what the same tokens would take as fp32 full-vocabulary logits


@dataclass(frozen=True)
class StoreSummary:
    path: str
    format_version: int
    created_by: str
    hidden_dtype: str
    codec: str
    rows: int
    tokens: int
    vocab_size: int  # the tokenizer's tokens; each teacher's output layer may pad past them
    teachers: list[TeacherSummary]

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.teachers)

    @property
    def compression_ratio(self) -> float:
        logical = sum(t.logical_bytes for t in self.teachers)
        return logical / self.stored_bytes if self.stored_bytes else float("nan")


def summarise_store(root: str | Path) -> StoreSummary:
    manifest = read_manifest(root)
    itemsize = storage_dtype(manifest.storage.hidden_dtype).itemsize
    teachers = []
    for teacher in manifest.teachers:
        shards = [s for s in manifest.shards if s.teacher == teacher.index]
        tokens = sum(s.tokens for s in shards)
        teachers.append(
            TeacherSummary(
                index=teacher.index,
                aliases=teacher.aliases,
                checkpoint=teacher.checkpoint,
                fingerprint=teacher.fingerprint,
                hidden_size=teacher.hidden_size,
                vocab_size=teacher.vocab_size,
                rows=sum(s.rows for s in shards),
                tokens=tokens,
                stored_bytes=sum(s.bytes for s in shards),
                logical_bytes=tokens * teacher.hidden_size * itemsize,
                full_logit_bytes=tokens * teacher.vocab_size * 4,
            )
        )
    return StoreSummary(
        path=str(root),
        format_version=manifest.format_version,
        created_by=manifest.created_by,
        hidden_dtype=manifest.storage.hidden_dtype,
        codec=manifest.storage.codec,
        rows=manifest.dataset.num_rows,
        tokens=manifest.dataset.num_tokens,
        vocab_size=manifest.tokenizer.vocab_size,
        teachers=teachers,
    )
