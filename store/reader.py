"""The public read API: `open_store(path) -> TeacherStore` (DESIGN §4). Readers trust only the manifest.

Every read goes through `ArrayReader`, which refuses a missing, truncated, undecodable or (format 2)
bit-flipped chunk with an error naming the array and the chunk. A format-1 store wrote no checksums and
skipped all-zero chunks; its arrays are checked on opening against their part records (every recorded
chunk file present, at its recorded size), and `FORMAT_1_NOTE` says what that leaves unchecked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from mopd.store.arrays import from_storage
from mopd.store.chunks import ArrayReader
from mopd.store.errors import ManifestError, StoreIncompleteError, StoreIntegrityError
from mopd.store.fsio import safe_join
from mopd.store.layout import HIDDEN, INPUT_IDS, LOSS_MASK, OFFSETS, ROW_IDS, TEACHER_INDEX
from mopd.store.manifest import (
    MANIFEST_FILE,
    PARTS_DIR,
    PLAN_FILE,
    Manifest,
    TeacherEntry,
    load_manifest,
    load_part,
    load_plan,
)
from mopd.store.transform import LogitTransform

FORMAT_1_NOTE = (
    "store format 1 has no per-chunk checksums: reads find missing and truncated chunk files, but a "
    "changed byte only `mopd verify-manifest --full` finds; rebuild the store for checked reads"
)


@dataclass(frozen=True)
class Row:
    """One stored row. `loss_mask[t]` is 1 where the prediction made at position t (of token t+1) trains."""

    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    teacher_index: int


def task_progress(root: Path) -> tuple[int, int]:
    """(done, total) tasks of an unfinalized store, from its plan and part records."""
    plan = load_plan(root / PLAN_FILE)
    done = sum((root / PARTS_DIR / f"{task.task_id}.json").exists() for task in plan.tasks)
    return done, len(plan.tasks)


def read_manifest(root: Path) -> Manifest:
    """The store's manifest; a missing one is reported with how many tasks are done.

    Raises:
        StoreIncompleteError: no manifest yet (message says done/total tasks and what to run).
        ManifestError: not a store, or an unsupported format.
    """
    try:
        return load_manifest(root / MANIFEST_FILE)
    except FileNotFoundError:
        pass
    if not root.is_dir():
        raise ManifestError(f"store {root} does not exist")
    if not (root / PLAN_FILE).exists():
        raise ManifestError(f"{root} is not a mopd store: it has no {MANIFEST_FILE} and no {PLAN_FILE}")
    done, total = task_progress(root)
    raise StoreIncompleteError(
        f"{root} has no {MANIFEST_FILE}: {done} of {total} tasks are done; run `mopd precompute` again "
        "with the same config to finish it (finished tasks are skipped)"
    )


class TeacherStore:
    """A finalized teacher store, read-only.

    Args:
        root: the store folder.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self._artifacts = {a.path: a for a in self.manifest.artifacts()}
        rows = self._array(self.manifest.rows.path, OFFSETS)
        if rows.shape != (self.manifest.dataset.num_rows + 1,):
            raise StoreIntegrityError(
                f"{self.root}: rows/offsets has shape {rows.shape}, the manifest records "
                f"{self.manifest.dataset.num_rows} rows"
            )
        self._offsets = rows.read().astype(np.int64)
        self._teachers = {t.index: t for t in self.manifest.teachers}

    @property
    def format_note(self) -> str | None:
        """What this store's format leaves unchecked at read time (None: every chunk is verified)."""
        return FORMAT_1_NOTE if self.manifest.storage.checksum is None else None

    @functools.lru_cache(maxsize=256)  # noqa: B019 - the store lives as long as its arrays
    def _array(self, folder: str, name: str = "") -> ArrayReader:
        path = safe_join(self.root, folder)
        label = f"{folder}/{name}".rstrip("/")
        if not path.exists():
            raise StoreIntegrityError(f"{path} is listed in the manifest but missing; run verify-manifest")
        legacy = self.manifest.storage.checksum is None
        if legacy:
            self._check_recorded_files(folder, name)
        return ArrayReader(path / name if name else path, label=label, fill_missing=legacy)

    def _check_recorded_files(self, folder: str, name: str) -> None:
        """Format 1: every chunk file the part record lists for this array exists at its recorded size."""
        artifact = self._artifacts[folder]
        part = load_part(self.root / PARTS_DIR / f"{artifact.task_id}.json", format_version=1)
        for rel, (size, _digest) in part.files.items():
            if name and not rel.startswith(f"{name}/"):
                continue
            path = safe_join(self.root, f"{folder}/{rel}")
            found = path.stat().st_size if path.is_file() else None
            if found != size:
                state = "missing" if found is None else f"{found} bytes, recorded {size} (truncated?)"
                raise StoreIntegrityError(
                    f"{folder}/{rel}: {state}; the store is damaged (`mopd verify-manifest --full` lists "
                    "every damaged file)"
                )

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
        """[R] teacher index of every row."""
        return self._row_arrays[2]

    @property
    def lengths(self) -> np.ndarray:
        """[R] token count of every row."""
        return np.diff(self._offsets)

    def _check_row(self, i: int) -> None:
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range: the store has {self.num_rows} rows")

    def row(self, i: int) -> Row:
        self._check_row(i)
        input_ids, loss_mask, teacher_index = self._row_arrays
        start, stop = int(self._offsets[i]), int(self._offsets[i + 1])
        return Row(
            input_ids=torch.from_numpy(input_ids.read(start, stop).astype(np.int64)),
            loss_mask=torch.from_numpy(loss_mask.read(start, stop).astype(bool)),
            teacher_index=int(teacher_index[i]),
        )

    @cached_property
    def _row_locations(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: which shard (index into manifest.shards) holds it, and its position there."""
        shard_of = np.full(self.num_rows, -1, dtype=np.int64)
        position = np.full(self.num_rows, -1, dtype=np.int64)
        for k, shard in enumerate(self.manifest.shards):
            row_ids = self._array(shard.path, ROW_IDS).read().astype(np.int64)
            shard_of[row_ids] = k
            position[row_ids] = np.arange(row_ids.shape[0])
        return shard_of, position

    def hidden(self, i: int) -> torch.Tensor:
        """The row's stored teacher hidden states, [L, H], in the stored logical dtype."""
        self._check_row(i)
        shard_of, position = self._row_locations
        if shard_of[i] < 0:
            raise StoreIntegrityError(f"row {i} is in no shard of the manifest")
        shard = self.manifest.shards[int(shard_of[i])]
        p = int(position[i])
        start, stop = (int(x) for x in self._array(shard.path, OFFSETS).read(p, p + 2))
        hidden = self._array(shard.path, HIDDEN)
        return from_storage(hidden.read(start, stop), hidden.logical_dtype)

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

    def _head_position(self, teacher_index: int) -> int:
        return next(k for k, a in enumerate(self.manifest.lm_heads) if a.teacher == teacher_index)

    def teacher_logits(self, i: int) -> torch.Tensor:
        """The row's teacher logits rebuilt from its hidden states, transform applied, fp32 [L, V]."""
        entry = self.teacher(self.row(i).teacher_index)
        logits = self.hidden(i).float() @ self.lm_head(entry.index).float().T
        return LogitTransform(entry.logit_scale, entry.final_logit_softcap).apply(logits)


def open_store(path: str | Path) -> TeacherStore:
    """Opens a finalized store for reading.

    Raises:
        StoreIncompleteError: the store has no manifest yet (says how many tasks are done).
        ManifestError: not a store, unsupported format version or unknown required feature.
        StoreIntegrityError: arrays disagree with the recorded shapes, or a chunk cannot be read.
    """
    return TeacherStore(path)
