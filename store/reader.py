"""The public read API: `open_store(path) -> TeacherStore` (DESIGN §4). Readers trust only the manifest.

Every read goes through `ArrayReader`, which refuses a missing, truncated, undecodable or bit-flipped
chunk with an error naming the array and the chunk, and is given the array's files as its part record
lists them (the record itself proved by the manifest's sha256 of it): a file copied in from elsewhere is
refused, and so is a symbolic link anywhere in the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from mopd.base.errors import ManifestError, StoreIntegrityError
from mopd.base.fsio import safe_relative
from mopd.store.arrays.binding import Recorded
from mopd.store.arrays.dtypes import TORCH_DTYPES, from_storage
from mopd.store.arrays.read import ArrayReader, ChunkCache
from mopd.store.codec.int8_rotated import Encoding
from mopd.store.format.layout import (
    ALIGNED,
    CODES,
    HIDDEN,
    INPUT_IDS,
    LOSS_MASK,
    OFFSETS,
    ROW_IDS,
    SCALES,
    SOURCE,
    STUDENT_SPAN,
    TARGET,
    TEACHER_INDEX,
    TEACHER_SET,
    TEACHER_SPAN,
    TOKEN_IDS,
    WEIGHT,
    set_members,
)
from mopd.store.format.loading import part_key, read_manifest, read_record
from mopd.store.format.manifest import EncodingInfo, PartRecord, ShardArtifact, TeacherEntry, parse_part
from mopd.store.format.transform import LogitTransform
from mopd.store.locations.location import Location, open_location, shared_pool
from mopd.store.task_writers import read_encoding

# Arrays read at once by one call of `rows` or `hiddens`: a step's shards are read concurrently, so that
# a store in a bucket costs a step about one round trip per array, not one per shard in turn.
_ARRAYS_IN_FLIGHT = 16


def _fanout() -> ThreadPoolExecutor:
    return shared_pool("arrays", _ARRAYS_IN_FLIGHT)


@dataclass(frozen=True)
class Row:
    """One stored row. `loss_mask[t]` is 1 where the prediction made at position t (of token t+1) trains."""

    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    teacher_index: int  # its teacher (of several, the lowest index)
    teachers: tuple[int, ...] = ()  # every teacher that scores it, ascending (DESIGN §14)


class TeacherStore:
    """A finalized teacher store, read-only.

    Args:
        root: the store: a folder, an object-storage URL, or its `Location`.
        options: the object-storage client's settings (`store.options`).
    """

    def __init__(self, root: str | Path | Location, options: Mapping[str, str] | None = None) -> None:
        self.location = open_location(root, options)
        # The store's folder (a Path), or its URL in a bucket.
        self.root: Path | str = self.location.local_folder() or self.location.url
        self.cache = ChunkCache()  # the decoded chunks this store's reads keep for reuse (bounded)
        # What the store opened once, kept while it lives: each array's reader, each task folder's part
        # record, each teacher's encoding (as many as the store has arrays, tasks and teachers).
        self._arrays: dict[tuple[str, str], ArrayReader] = {}
        self._parts: dict[str, PartRecord] = {}
        self._encodings: dict[int, tuple[Encoding, EncodingInfo] | None] = {}
        self.manifest = read_manifest(self.location)
        self._artifacts = {a.path: a for a in self.manifest.artifacts()}
        rows = self._array(self.manifest.rows.path, OFFSETS)
        if rows.shape != (self.manifest.dataset.num_rows + 1,):
            raise StoreIntegrityError(
                f"{self.root}: rows/offsets has shape {rows.shape}, the manifest records "
                f"{self.manifest.dataset.num_rows} rows"
            )
        self._offsets = rows.read().astype(np.int64)
        self._teachers = {t.index: t for t in self.manifest.teachers}

    def _array(self, folder: str, name: str = "") -> ArrayReader:
        if (folder, name) not in self._arrays:
            self._arrays[folder, name] = self._open_array(folder, name)
        return self._arrays[folder, name]

    def _open_array(self, folder: str, name: str) -> ArrayReader:
        label = safe_relative(f"{folder}/{name}".rstrip("/"))
        if not self.location.is_folder(label):
            raise StoreIntegrityError(
                f"{self.location.describe(label)} is listed in the manifest but missing; run verify-manifest"
            )
        recorded = self._recorded(folder, name)
        return ArrayReader(self.location, label, label=label, recorded=recorded, cache=self.cache)

    def _recorded(self, folder: str, name: str) -> Recorded | None:
        """What the part record of the task folder says of its array `name`."""
        return Recorded.of(self._part(folder).files, name)

    def _part(self, folder: str) -> PartRecord:
        """The part record of the task folder, proved to be the one the manifest lists."""
        if folder not in self._parts:
            self._parts[folder] = self._read_part(folder)
        return self._parts[folder]

    def _read_part(self, folder: str) -> PartRecord:
        artifact = self._artifacts[folder]
        key = part_key(artifact.task_id)
        path = self.location.describe(key)
        try:
            data = read_record(self.location, key, "part record")
        except FileNotFoundError:
            raise StoreIntegrityError(f"{path} is missing; run verify-manifest") from None
        if hashlib.sha256(data).hexdigest() != artifact.part_sha256:
            raise StoreIntegrityError(
                f"{path} is not the part record the manifest lists (its sha256 differs); run verify-manifest"
            )
        return parse_part(data, path)

    @property
    def num_rows(self) -> int:
        return self.manifest.dataset.num_rows

    @property
    def teachers(self) -> list[TeacherEntry]:
        return list(self.manifest.teachers)

    def teacher(self, teacher_index: int) -> TeacherEntry:
        if teacher_index not in self._teachers:
            raise ManifestError(
                f"teacher {teacher_index} is not in the store (it has {sorted(self._teachers)})"
            )
        return self._teachers[teacher_index]

    @cached_property
    def _row_arrays(self) -> tuple[ArrayReader, ArrayReader, np.ndarray]:
        path = self.manifest.rows.path
        return (
            self._array(path, INPUT_IDS),
            self._array(path, LOSS_MASK),
            self._array(path, TEACHER_INDEX).read().astype(np.int64),
        )

    @property
    def teacher_indices(self) -> np.ndarray:
        """[R] teacher index of every row (of a row of several, the lowest)."""
        return self._row_arrays[2]

    @cached_property
    def teacher_sets(self) -> np.ndarray | None:
        """[R] each row's teachers as `layout.set_mask` bits; None in a store whose rows have one each."""
        if not self.manifest.dataset.teacher_sets:
            return None
        return self._array(self.manifest.rows.path, TEACHER_SET).read().astype(np.int64)

    def teachers_of(self, i: int) -> tuple[int, ...]:
        """The teachers that score row i, ascending."""
        sets = self.teacher_sets
        return (int(self.teacher_indices[i]),) if sets is None else set_members(int(sets[i]))

    @property
    def lengths(self) -> np.ndarray:
        """[R] token count of every row."""
        return np.diff(self._offsets)

    def row(self, i: int) -> Row:
        return self.rows([i])[0]

    def rows(self, indices: Sequence[int] | np.ndarray) -> list[Row]:
        """The rows `indices`, in that order; each stored chunk they touch is decoded at most once."""
        indices = self._checked(indices)
        input_ids, loss_mask, teacher_index = self._row_arrays
        starts, stops = self._offsets[indices], self._offsets[indices + 1]
        ids, mask = _fanout().map(lambda array: array.gather(starts, stops), (input_ids, loss_mask))
        cuts = np.cumsum(stops - starts)[:-1]
        return [
            Row(
                input_ids=torch.from_numpy(row_ids.astype(np.int64)),
                loss_mask=torch.from_numpy(row_mask.astype(bool)),
                teacher_index=int(teacher_index[i]),
                teachers=self.teachers_of(int(i)),
            )
            for row_ids, row_mask, i in zip(np.split(ids, cuts), np.split(mask, cuts), indices, strict=True)
        ]

    def _checked(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = indices[(indices < 0) | (indices >= self.num_rows)]
        if bad.size:
            raise IndexError(f"row {int(bad[0])} out of range: the store has {self.num_rows} rows")
        return indices

    @cached_property
    def _row_locations(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per teacher, per row: which of its shards (index into manifest.shards) holds the row's states
        (−1: none), and where they start and stop in that shard's `hidden`. Read once, from every shard's
        row ids and offsets."""
        out = {}
        for t in self._teachers:
            shard_of = np.full(self.num_rows, -1, dtype=np.int64)
            starts = np.zeros(self.num_rows, dtype=np.int64)
            stops = np.zeros(self.num_rows, dtype=np.int64)
            out[t] = shard_of, starts, stops
        for k, shard in enumerate(self.manifest.shards):
            shard_of, starts, stops = out[shard.teacher]
            row_ids = self._array(shard.path, ROW_IDS).read().astype(np.int64)
            offsets = self._array(shard.path, OFFSETS).read().astype(np.int64)
            shard_of[row_ids], starts[row_ids], stops[row_ids] = k, offsets[:-1], offsets[1:]
        return out

    def hidden(self, i: int) -> torch.Tensor:
        """The row's stored teacher hidden states, [L, H], in the stored logical dtype (`store.dtype`; an
        int8-rotated store's decoded states are rounded to it)."""
        return self.hiddens([i])[0]

    def encoding(self, teacher_index: int) -> tuple[Encoding, EncodingInfo] | None:
        """An int8-rotated store's encoding of the teacher, and what its fit measured; None in an exact
        store, or for a teacher with no rows."""
        if teacher_index not in self._encodings:
            self.teacher(teacher_index)
            folder = next((a.path for a in self.manifest.encodings if a.teacher == teacher_index), None)
            found = None if folder is None else read_encoding(self.location, folder, self._part(folder))
            self._encodings[teacher_index] = found
        return self._encodings[teacher_index]

    def _states(self, shard: ShardArtifact, starts: np.ndarray, stops: np.ndarray) -> torch.Tensor:
        """A shard's states of the token ranges [starts, stops), end to end, decoded when encoded."""
        coded = self.encoding(shard.teacher)
        if coded is None:
            hidden = self._array(shard.path, HIDDEN)
            return from_storage(hidden.gather(starts, stops), hidden.logical_dtype)
        codes, scales = (self._array(shard.path, name).gather(starts, stops) for name in (CODES, SCALES))
        states = coded[0].decode(torch.from_numpy(codes), torch.from_numpy(scales))
        return states.to(TORCH_DTYPES[self.manifest.storage.hidden_dtype])

    def hiddens(self, indices: Sequence[int] | np.ndarray, teacher: int | None = None) -> list[torch.Tensor]:
        """The hidden states of rows `indices` (those of `teacher`, which must score each; default each
        row's teacher index), in that order; one gather per shard they fall in, so each stored chunk is
        decoded at most once."""
        indices = self._checked(indices)
        locations = self._row_locations
        if teacher is None:
            teachers = self.teacher_indices[indices]
            where_of = {t: locations[t] for t in np.unique(teachers).tolist()}
            shard_of = np.full(indices.shape[0], -1, dtype=np.int64)
            starts, stops = np.zeros_like(shard_of), np.zeros_like(shard_of)
            for t, (shards, first, last) in where_of.items():
                mine = teachers == t
                shard_of[mine], starts[mine], stops[mine] = (a[indices[mine]] for a in (shards, first, last))
        else:
            self.teacher(teacher)
            shard_of, starts, stops = (a[indices] for a in locations[teacher])
        orphans = indices[shard_of < 0]
        if orphans.size:
            raise StoreIntegrityError(f"row {int(orphans[0])} is in no shard of the manifest")
        out: list[torch.Tensor] = [torch.empty(0)] * indices.shape[0]

        def read(k: int) -> tuple[np.ndarray, list[torch.Tensor]]:
            where = np.flatnonzero(shard_of == k)
            states = self._states(self.manifest.shards[k], starts[where], stops[where])
            return where, list(states.split((stops - starts)[where].tolist()))

        for where, parts in _fanout().map(read, np.unique(shard_of).tolist()):
            for position, part in zip(where.tolist(), parts, strict=True):
                out[position] = part
        return out

    def lm_head(
        self, teacher_index: int, vocab_start: int = 0, vocab_stop: int | None = None
    ) -> torch.Tensor:
        """Rows [vocab_start, vocab_stop) of a teacher's LM head, [vocab_stop − vocab_start, H].

        Reads only the chunks overlapping the slice. Rows past the vocabulary (a tensor-parallel
        rank's padding) are returned as zeros.
        """
        entry = self.teacher(teacher_index)
        vocab_stop = entry.vocab_size if vocab_stop is None else vocab_stop
        if not 0 <= vocab_start <= vocab_stop:
            raise ValueError(f"bad vocabulary slice [{vocab_start}, {vocab_stop})")
        head = self._array(self.manifest.lm_heads[self._head_position(teacher_index)].path)
        stored_stop = min(vocab_stop, entry.vocab_size)
        part = from_storage(head.read(vocab_start, max(vocab_start, stored_stop)), entry.dtype)
        if stored_stop == vocab_stop:
            return part
        padding = torch.zeros(vocab_stop - max(stored_stop, vocab_start), entry.hidden_size, dtype=part.dtype)
        return torch.cat([part, padding])

    @cached_property
    def _aligned_locations(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row of a teacher of another tokenizer: where its student positions start in its shard's
        alignment arrays (its rows' positions end to end, in row_ids order), and that shard's index."""
        shard_of = np.full(self.num_rows, -1, dtype=np.int64)
        starts = np.zeros(self.num_rows, dtype=np.int64)
        lengths = self.lengths
        for k, shard in enumerate(self.manifest.shards):
            if self.teacher(shard.teacher).tokenizer is None:
                continue
            row_ids = self._array(shard.path, ROW_IDS).read().astype(np.int64)
            shard_of[row_ids] = k
            starts[row_ids] = np.concatenate([[0], np.cumsum(lengths[row_ids])[:-1]])
        return shard_of, starts

    def alignment(self, i: int) -> StoredAlignment:
        """Row i's alignment with its teacher of another tokenizer (`layout.shard_arrays`).

        Raises:
            ValueError: the row's teachers share the store's tokenizer.
        """
        shard, student = self._aligned_row(i)
        _, token_starts, token_stops = self._row_locations[shard.teacher]
        own = slice(int(token_starts[i]), int(token_stops[i]))
        read = lambda name, span: self._array(shard.path, name).read(span.start, span.stop)  # noqa: E731
        return StoredAlignment(
            token_ids=read(TOKEN_IDS, own).astype(np.int64),
            teacher_span=read(TEACHER_SPAN, own).astype(np.int64),
            aligned=read(ALIGNED, student).astype(np.int64),
            student_span=read(STUDENT_SPAN, student).astype(np.int64),
        )

    def aligned(self, i: int) -> np.ndarray:
        """`alignment(i).aligned` alone (what training reads of a row): [L] the teacher position aligned
        with each position, −1 for none."""
        shard, student = self._aligned_row(i)
        return self._array(shard.path, ALIGNED).read(student.start, student.stop).astype(np.int64)

    def other_tokenizer(self, i: int) -> int | None:
        """Row i's teacher of another tokenizer than the store's (a row has at most one), or None."""
        return next((t for t in self.teachers_of(i) if self.teacher(t).tokenizer is not None), None)

    def _aligned_row(self, i: int) -> tuple[ShardArtifact, slice]:
        """The shard holding row i's alignment (with its teacher of another tokenizer), and the row's
        positions in its alignment arrays."""
        if self.other_tokenizer(int(self._checked([i])[0])) is None:
            raise ValueError(f"row {i}'s teachers share the store's tokenizer: no alignment")
        shard_of, starts = self._aligned_locations
        start = int(starts[i])
        return self.manifest.shards[int(shard_of[i])], slice(start, start + int(self.lengths[i]))

    def projection(self, teacher_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A teacher of another tokenizer's projection onto the store's vocabulary: its entries' source
        (teacher token), target (store token) and weight (`mopd.tokens.projection.Projection`).

        Raises:
            ValueError: the teacher shares the store's tokenizer.
        """
        entry = self.teacher(teacher_index)
        artifact = next((a for a in self.manifest.projections if a.teacher == teacher_index), None)
        if entry.tokenizer is None or artifact is None:
            raise ValueError(f"teacher {teacher_index} shares the store's tokenizer: no projection")
        source, target, weight = (
            self._array(artifact.path, name).read() for name in (SOURCE, TARGET, WEIGHT)
        )
        return source.astype(np.int64), target.astype(np.int64), weight.astype(np.float32)

    def _head_position(self, teacher_index: int) -> int:
        return next(k for k, a in enumerate(self.manifest.lm_heads) if a.teacher == teacher_index)

    def teacher_logits(self, i: int) -> torch.Tensor:
        """The row's teacher logits rebuilt from its hidden states, transform applied, fp32 [L, V]."""
        entry = self.teacher(self.row(i).teacher_index)
        logits = self.hidden(i).float() @ self.lm_head(entry.index).float().T
        return LogitTransform(entry.logit_scale, entry.final_logit_softcap).apply(logits)


@dataclass(frozen=True)
class StoredAlignment:
    """A row's alignment with its teacher of another tokenizer: the teacher's own tokens and each of its
    positions' span, and for each student position the aligned teacher position and span (−1: none)."""

    token_ids: np.ndarray  # [L_teacher]
    teacher_span: np.ndarray  # [L_teacher]
    aligned: np.ndarray  # [L_student]
    student_span: np.ndarray  # [L_student]


def open_store(path: str | Path | Location, options: Mapping[str, str] | None = None) -> TeacherStore:
    """Opens a finalized store for reading: a folder or an object-storage URL (`options`: the client's
    settings, `store.options`).

    Raises:
        StoreIncompleteError: the store has no manifest yet (says how many tasks are done).
        ManifestError: not a store, unsupported format version or unknown required feature.
        StoreIntegrityError: arrays disagree with the recorded shapes, or a chunk cannot be read.
    """
    return TeacherStore(path, options)
