"""The dataset after tokenisation and routing: its Arrow columns, each row's teachers, and its
fingerprint (the store's dataset identity)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mopd.precompute.cross_rows import CROSS_COLUMNS
from mopd.store.format.layout import TEACHER_SET, scored_by


class RaggedColumn:
    """One list column of the tokenised rows, read row by row from its (memory-mapped) Arrow buffers."""

    def __init__(self, column: pa.ChunkedArray, dtype: type) -> None:
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._values = pc.list_flatten(column)
        self._dtype = dtype

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def __getitem__(self, i: int) -> np.ndarray:
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return self._values.slice(start, stop - start).to_numpy(zero_copy_only=False).astype(self._dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def pieces(self, size: int = 1 << 22) -> Iterator[np.ndarray]:
        """Every row's values end to end, in pieces of `size` values in their stored dtype (memory stays
        bounded by one piece; row i is values[offsets[i]:offsets[i + 1]])."""
        for start in range(0, int(self.offsets[-1]), size):
            yield self._values.slice(start, size).to_numpy(zero_copy_only=False)


class TokenizedRows:
    """The dataset after tokenisation and routing, as Arrow columns; row i of each is row i of the store.

    Row metadata (lengths, teacher index) is held in memory; tokens and masks are read per row from the
    Arrow buffers (memory-mapped when the rows come from the ingest cache), so a job touches only the
    rows of its own tasks.
    """

    def __init__(self, table: pa.Table, meta: Mapping[str, Any]) -> None:
        self.table = table
        self.meta = dict(meta)
        self.input_ids = RaggedColumn(table.column("input_ids"), np.int64)
        self.loss_mask = RaggedColumn(table.column("loss_mask"), np.uint8)
        self.teacher_index = table.column("teacher_index").to_numpy().astype(np.int64)
        # Each row's teachers (`store.format.layout.set_mask`); None when every row has one.
        sets = (
            table.column(TEACHER_SET).to_numpy().astype(np.int64)
            if TEACHER_SET in table.column_names
            else None
        )
        several = sets is not None and bool((sets & (sets - 1)).any())
        self.teacher_set: np.ndarray | None = sets if several else None
        self.lengths = np.diff(self.input_ids.offsets)
        self.input_format: str = meta["input_format"]
        # Rows of a store with teachers of other tokenizers: the `cross_rows.CROSS_COLUMNS`, by name.
        self.cross = {
            name: RaggedColumn(table.column(name), np.dtype(dtype).type)
            for name, dtype in CROSS_COLUMNS.items()
            if name in table.column_names
        }
        self.num_truncated: int = meta["num_truncated"]
        self.num_dropped: int = meta["num_dropped"]
        self._fingerprint: str = meta["fingerprint"]

    @classmethod
    def from_lists(
        cls,
        input_ids: Sequence[np.ndarray],
        loss_mask: Sequence[np.ndarray],
        *,
        teacher_index: np.ndarray,
        source_keys: Sequence[str],
        input_format: str = "input_ids",
        teacher_set: np.ndarray | None = None,
    ) -> TokenizedRows:
        """Rows held in memory (benchmarks and tests), with the fingerprint computed as ingest does."""
        sets = {} if teacher_set is None else {TEACHER_SET: pa.array(np.asarray(teacher_set, np.int64))}
        table = pa.table(
            {
                "input_ids": pa.array([np.asarray(r, np.int32) for r in input_ids], pa.list_(pa.int32())),
                "loss_mask": pa.array([np.asarray(m, np.uint8) for m in loss_mask], pa.list_(pa.uint8())),
                "agent": pa.array([""] * len(input_ids), pa.string()),
                "source_key": pa.array(list(source_keys), pa.string()),
                "teacher_index": pa.array(np.asarray(teacher_index, np.int16)),
                "truncated": pa.array([False] * len(input_ids)),
                **sets,
            }
        )
        meta = {"input_format": input_format, "num_truncated": 0, "num_dropped": 0}
        return cls(table, {**meta, "fingerprint": rows_fingerprint(table)})

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    def rows_of(self, teacher: int) -> np.ndarray:
        """The ids of the rows `teacher` scores, ascending."""
        return np.flatnonzero(scored_by(self.teacher_index, self.teacher_set, teacher))

    def other_tokenizer(self, others: Collection[int]) -> np.ndarray:
        """[R] each row's teacher of another tokenizer (`others`; a row has at most one), −1 for none."""
        out = np.full(self.num_rows, -1, dtype=np.int64)
        for t in sorted(others, reverse=True):
            out[self.rows_of(t)] = t
        return out

    def token_rows(self, own: bool) -> tuple[RaggedColumn, np.ndarray]:
        """The token rows a teacher reads and their lengths: the store's, or (`own`: a teacher of another
        tokenizer) its own."""
        if not own:
            return self.input_ids, self.lengths
        column = self.cross["teacher_ids"]
        return column, np.diff(column.offsets)

    @property
    def num_trained(self) -> int:
        """Tokens whose next-token prediction is trained (loss_mask 1), over every row."""
        return int(pc.sum(pc.list_flatten(self.table.column("loss_mask"))).as_py() or 0)

    @property
    def agents(self) -> list[str]:
        return [str(a) for a in self.table.column("agent").to_pylist()]

    @property
    def source_keys(self) -> list[str]:
        return [str(k) for k in self.table.column("source_key").to_pylist()]

    def fingerprint(self) -> str:
        """sha256 of every row's tokens, mask, teacher index (or set) and source key: the dataset's
        identity."""
        return self._fingerprint


def rows_fingerprint(table: pa.Table) -> str:
    """The dataset fingerprint of tokenised rows (`TokenizedRows.fingerprint`), in one pass over them:
    per row, its length (int64), tokens (int32), mask (uint8), teacher index (int64), source key, NUL."""
    digest = hashlib.sha256()
    for batch in table.to_batches(max_chunksize=8192):
        ids, masks = batch.column("input_ids"), batch.column("loss_mask")
        lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        id_bytes = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype("<i4").tobytes()
        mask_bytes = pc.list_flatten(masks).to_numpy(zero_copy_only=False).astype(np.uint8).tobytes()
        teachers = batch.column("teacher_index").to_numpy(zero_copy_only=False).astype("<i8")
        sets = (
            batch.column(TEACHER_SET).to_numpy(zero_copy_only=False).astype("<i8")
            if TEACHER_SET in batch.schema.names
            else teachers * 0
        )
        keys = batch.column("source_key").to_pylist()
        parts = []
        for k in range(lengths.shape[0]):
            a, b = int(offsets[k]), int(offsets[k + 1])
            parts += [
                lengths[k : k + 1].astype("<i8").tobytes(),
                id_bytes[4 * a : 4 * b],
                mask_bytes[a:b],
                teachers[k : k + 1].tobytes(),
                # A row of several teachers adds its set (one teacher's row hashes as it always has).
                b"" if sets[k] & (sets[k] - 1) == 0 else b"set" + sets[k : k + 1].tobytes(),
                str(keys[k]).encode(),
                b"\0",
            ]
        digest.update(b"".join(parts))
    return digest.hexdigest()
