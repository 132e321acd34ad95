"""What each kind of task writes into its folder: rows, an LM head, a hidden-state shard, a teacher's
encoding (the arrays `layout.py` declares)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from mopd.base.fsio import safe_relative
from mopd.store.arrays.binding import Recorded
from mopd.store.arrays.dtypes import to_storage, torch_logical_dtype
from mopd.store.arrays.read import ArrayReader
from mopd.store.arrays.write import ArrayAppender
from mopd.store.codec.int8_rotated import Encoding
from mopd.store.format.layout import (
    ALIGNED,
    CODES,
    HIDDEN,
    INPUT_IDS,
    LOSS_MASK,
    MEAN,
    MIX,
    OFFSETS,
    ROW_IDS,
    SCALES,
    SIGNS,
    SOURCE,
    SOURCE_KEY,
    STUDENT_SPAN,
    TARGET,
    TEACHER_INDEX,
    TEACHER_SET,
    TEACHER_SPAN,
    TOKEN_IDS,
    WEIGHT,
    encoding_arrays,
    head_array,
    projection_arrays,
    rows_arrays,
    shard_arrays,
)
from mopd.store.format.loading import read_calibration
from mopd.store.format.manifest import (
    CALIBRATION_FILE,
    EXACT,
    INT8_ROTATED,
    AlignmentCounts,
    EncodingInfo,
    HeadInfo,
    PartRecord,
    canonical_json,
)
from mopd.store.locations.location import Location
from mopd.store.writer import TaskOutput


def pack_rows(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows end to end, and where each starts: (values, offsets [R + 1])."""
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    values = np.concatenate(rows) if len(rows) else np.zeros(0)
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def write_rows(
    output: TaskOutput,
    *,
    input_ids: Iterable[np.ndarray],
    loss_mask: Iterable[np.ndarray],
    offsets: np.ndarray,
    teacher_index: np.ndarray,
    source_keys: Sequence[str],
    teacher_set: np.ndarray | None = None,
) -> None:
    """Writes every row's tokens, loss mask, teacher index (with `teacher_set`, each row's set of
    teachers too) and source key. Tokens and masks come packed
    end to end, in pieces of any size (row i is values[offsets[i]:offsets[i + 1]], see `pack_rows`), and
    are streamed to the store, so memory stays bounded by a piece and a chunk whatever the row count.

    `loss_mask[t] = 1` means the prediction made at position t (of token t+1) is trained.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    num_rows, num_tokens = offsets.shape[0] - 1, int(offsets[-1])
    arrays = rows_arrays(num_rows, num_tokens, teacher_set is not None)
    for spec, pieces in ((arrays[INPUT_IDS], input_ids), (arrays[LOSS_MASK], loss_mask)):
        appender = output.appender(spec)
        for piece in pieces:
            appender.append(np.asarray(piece).astype(spec.dtype, copy=False))
        appender.close()  # raises unless exactly num_tokens values came
    output.write(arrays[OFFSETS], offsets)
    output.write(arrays[TEACHER_INDEX], np.asarray(teacher_index, dtype=np.int16))
    if teacher_set is not None:
        output.write(arrays[TEACHER_SET], np.asarray(teacher_set, dtype=np.int64))
    output.write_strings(arrays[SOURCE_KEY], [str(key) for key in source_keys])
    output.num_rows = num_rows
    output.num_tokens = num_tokens


def write_lm_head(
    output: TaskOutput,
    head: torch.Tensor,
    *,
    logit_scale: float | None = None,
    final_logit_softcap: float | None = None,
) -> None:
    """Writes a teacher's LM head [V, H], chunked along V so a tensor-parallel rank reads its slice."""
    dtype = torch_logical_dtype(head.dtype)
    vocab_size, hidden_size = head.shape
    info = HeadInfo(
        vocab_size=int(vocab_size),
        hidden_size=int(hidden_size),
        dtype=dtype,
        logit_scale=logit_scale,
        final_logit_softcap=final_logit_softcap,
    )
    appender = output.appender(
        head_array(info.vocab_size, info.hidden_size, dtype),
        attributes={**info.model_dump(mode="json"), "padded_vocab_size": info.vocab_size},
    )
    appender.append(to_storage(head, dtype))
    output.head = info


def write_encoding(output: TaskOutput, encoding: Encoding, info: EncodingInfo) -> None:
    """Writes a teacher's int8-rotated encoding: its mean, its rotation's signs and Q, and what its fit
    measured (`CALIBRATION_FILE`)."""
    arrays = encoding_arrays(encoding.hidden_size)
    output.write(arrays[MEAN], encoding.mean.numpy())
    output.write(arrays[SIGNS], encoding.signs.numpy().astype(np.int8))
    output.write(arrays[MIX], encoding.mix.numpy())
    (output.folder / CALIBRATION_FILE).write_bytes(canonical_json(info.model_dump(mode="json")))


def read_encoding(location: Location, folder: str, part: PartRecord) -> tuple[Encoding, EncodingInfo]:
    """A published encoding task's encoding and calibration record, each file proved to be the one its
    part record lists."""
    info = read_calibration(location, folder, part)
    arrays = []
    for name in (MEAN, SIGNS, MIX):
        key = safe_relative(f"{folder}/{name}")
        recorded = Recorded.of(part.files, name)
        arrays.append(ArrayReader(location, key, label=key, recorded=recorded).read())
    return Encoding.of(*arrays), info


class HiddenShardWriter:
    """Streams one shard's hidden states: rows in a fixed order, each exactly its own length; exact in
    `dtype`, or as int8 codes and a scale a token when given the teacher's `encoding`."""

    def __init__(
        self,
        output: TaskOutput,
        *,
        row_ids: np.ndarray,
        lengths: np.ndarray,
        hidden_size: int,
        dtype: str,
        encoding: Encoding | None = None,
    ) -> None:
        self._output = output
        self._row_ids = np.asarray(row_ids, dtype=np.int64)
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self._dtype = dtype
        self._encoding = encoding
        self._next = 0
        total = int(self._lengths.sum())
        kind = EXACT if encoding is None else INT8_ROTATED
        self._arrays = shard_arrays(int(self._row_ids.shape[0]), total, hidden_size, dtype, kind)
        names = (HIDDEN,) if encoding is None else (CODES, SCALES)
        self._states: list[ArrayAppender] = [output.appender(self._arrays[name]) for name in names]
        output.num_rows = int(self._row_ids.shape[0])
        output.num_tokens = total

    def append(self, row_id: int, hidden: torch.Tensor) -> None:
        """Adds the next row's hidden states [L, H]; rows must come in the declared order."""
        if self._next >= self._row_ids.shape[0] or row_id != self._row_ids[self._next]:
            expected = self._row_ids[self._next] if self._next < self._row_ids.shape[0] else "none"
            raise ValueError(f"row {row_id} appended out of order (expected row {expected})")
        if hidden.shape[0] != self._lengths[self._next]:
            raise ValueError(
                f"row {row_id} has {hidden.shape[0]} hidden states, expected {self._lengths[self._next]}"
            )
        if self._encoding is None:
            self._states[0].append(to_storage(hidden, self._dtype))
        else:
            codes, scales = self._encoding.encode(hidden)
            self._states[0].append(codes.cpu().numpy())
            self._states[1].append(scales.cpu().numpy())
        self._next += 1

    def close(self) -> None:
        if self._next != self._row_ids.shape[0]:
            raise ValueError(f"shard closed after {self._next} of {self._row_ids.shape[0]} rows")
        offsets = np.concatenate([[0], np.cumsum(self._lengths)]).astype(np.int64)
        self._output.write(self._arrays[OFFSETS], offsets)
        self._output.write(self._arrays[ROW_IDS], self._row_ids)


def write_projection(
    output: TaskOutput, *, source: np.ndarray, target: np.ndarray, weight: np.ndarray
) -> None:
    """A teacher's projection onto the store's vocabulary: its entries (`layout.projection_arrays`)."""
    arrays = projection_arrays(int(source.shape[0]))
    output.write(arrays[SOURCE], np.asarray(source, np.int64))
    output.write(arrays[TARGET], np.asarray(target, np.int64))
    output.write(arrays[WEIGHT], np.asarray(weight, np.float32))
    output.num_tokens = int(source.shape[0])  # a projection's entries (it has no rows)


def write_alignment(
    output: TaskOutput,
    *,
    hidden_size: int,
    dtype: str,
    token_ids: Sequence[np.ndarray],
    teacher_span: Sequence[np.ndarray],
    aligned: Sequence[np.ndarray],
    student_span: Sequence[np.ndarray],
    trained: Sequence[np.ndarray],
) -> None:
    """The arrays a shard of a teacher of another tokenizer adds (`layout.shard_arrays`): per row, in
    the shard's row order, the teacher's own tokens and each teacher position's span, and each student
    position's aligned teacher position and span; its part record counts the rows' `trained` (loss-mask)
    positions, those aligned and those aligned or in a span. Call after the shard's states are written."""
    num_tokens, num_aligned = sum(map(len, token_ids)), sum(map(len, aligned))
    arrays = shard_arrays(len(token_ids), num_tokens, hidden_size, dtype, aligned_tokens=num_aligned)
    for name, rows in (
        (TOKEN_IDS, token_ids),
        (TEACHER_SPAN, teacher_span),
        (ALIGNED, aligned),
        (STUDENT_SPAN, student_span),
    ):
        values = pack_rows([np.asarray(r, np.int32) for r in rows])[0].astype(np.int32)
        output.write(arrays[name], values)
    output.aligned_tokens = num_aligned
    mask = np.concatenate([np.asarray(m, bool) for m in trained]) if trained else np.zeros(0, bool)
    has_teacher = np.concatenate(aligned)[mask] >= 0 if trained else mask
    in_span = np.concatenate(student_span)[mask] >= 0 if trained else mask
    output.alignment = AlignmentCounts(
        trained=int(mask.sum()), aligned=int(has_teacher.sum()), reached=int((has_teacher | in_span).sum())
    )
