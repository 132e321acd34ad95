"""What `mopd inspect` shows: per-teacher rows, tokens and bytes of a finalized store, in an int8-rotated
store what each teacher's encoding measured, and in a store of rows of several teachers, the rows of
each set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopd.store.arrays.write import storage_dtype
from mopd.store.format.layout import set_members
from mopd.store.format.loading import part_key, read_calibration, read_manifest, read_record
from mopd.store.format.manifest import EncodingInfo, Manifest, aligned_shares, parse_part
from mopd.store.locations.location import Location, open_location


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
    calibration: EncodingInfo | None = None  # an int8-rotated store's: what its encoding measured
    # A teacher of another tokenizer (DESIGN §13): its tokenizer, and the shares of its trained positions
    # aligned with one of its own, and aligned or inside a span of the same text.
    tokenizer: str | None = None
    aligned_share: float | None = None
    signal_share: float | None = None

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / self.tokens if self.tokens else float("nan")


@dataclass(frozen=True)
class StoreSummary:
    path: str
    format_version: int
    created_by: str
    hidden_dtype: str
    codec: str
    encoding: str
    rows: int
    tokens: int
    vocab_size: int  # the tokenizer's tokens; each teacher's output layer may pad past them
    teachers: list[TeacherSummary]
    # A store whose rows may have several teachers (DESIGN §14): the rows of each set of teacher
    # indices (one-teacher sets too), by set; empty in a store whose rows have one teacher each.
    rows_by_teachers: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.teachers)

    @property
    def compression_ratio(self) -> float:
        logical = sum(t.logical_bytes for t in self.teachers)
        return logical / self.stored_bytes if self.stored_bytes else float("nan")


def calibration(location: Location, manifest: Manifest, teacher: int) -> EncodingInfo | None:
    """What the teacher's encoding measured, an int8-rotated store's (None: exact, or no rows), its
    record proved to be the one its part record lists."""
    artifact = next((a for a in manifest.encodings if a.teacher == teacher), None)
    if artifact is None:
        return None
    part_path = location.describe(part_key(artifact.task_id))
    part = parse_part(read_record(location, part_key(artifact.task_id), "part record"), part_path)
    return read_calibration(location, artifact.path, part)


def summarise_store(root: str | Path) -> StoreSummary:
    location = open_location(root)
    manifest = read_manifest(location)
    itemsize = storage_dtype(manifest.storage.hidden_dtype).itemsize
    shares = aligned_shares(manifest)
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
                calibration=calibration(location, manifest, teacher.index),
                tokenizer=teacher.tokenizer.name if teacher.tokenizer else None,
                aligned_share=shares.get(teacher.index, (None, None))[0],
                signal_share=shares.get(teacher.index, (None, None))[1],
            )
        )
    return StoreSummary(
        path=str(root),
        format_version=manifest.format_version,
        created_by=manifest.created_by,
        hidden_dtype=manifest.storage.hidden_dtype,
        codec=manifest.storage.codec,
        encoding=manifest.storage.encoding,
        rows=manifest.dataset.num_rows,
        tokens=manifest.dataset.num_tokens,
        vocab_size=manifest.tokenizer.vocab_size,
        teachers=teachers,
        rows_by_teachers=_rows_by_teachers(location) if manifest.dataset.teacher_sets else {},
    )


def _rows_by_teachers(location: Location) -> dict[str, int]:
    """The store's rows of each set of teachers, keyed by their indices joined by `,`, in index order."""
    from mopd.store.reader import TeacherStore

    sets = TeacherStore(location).teacher_sets
    assert sets is not None
    masks, counts = np.unique(sets, return_counts=True)
    found = {set_members(int(m)): int(c) for m, c in zip(masks, counts, strict=True)}
    return {",".join(map(str, t)): found[t] for t in sorted(found, key=lambda t: (len(t), t))}
