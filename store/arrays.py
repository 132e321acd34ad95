"""Zarr v3 arrays of the store: creation, streaming chunk-aligned writes, logical dtypes.

zarr-python writes each array's metadata. Bulk writes go through tensorstore, which
encodes and writes chunks on its own thread pool: on two cores it writes a bf16 payload about twice as
fast as zarr-python (bench/store_io.py measures both). Both read and write the same standard zarr v3
arrays; bf16 is stored as uint16 bit patterns with the attribute `logical_dtype: "bfloat16"` because
zarr-python has no bfloat16 dtype (bit-exact round trip).

Reads never invent data. zarr fills a chunk that is not on disk with the fill value, which a trainer
would take for real zeros; format 2 therefore writes every chunk (zeros too) and ends each chunk's
codec chain with a crc32c checksum, and `chunks.ArrayReader` refuses a missing, truncated, undecodable
or bit-flipped chunk with a `StoreIntegrityError` naming the array and the chunk. (Format 1 stores
skipped all-zero chunks and carry no checksums: their readers check the files against the part records
instead, see `reader.py`.)
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from mopd.store import faults

CODECS = ("shuffle-zstd1", "none")
# Blosc splits a chunk into blocks; 1 MiB blocks give zstd enough context to reach the ~1.46x that
# byte-shuffled bf16 hidden states allow (the default 256 KiB gave 1.24x on the same data).
_BLOSC_BLOCK_BYTES = 1 << 20
_MAX_WRITES_IN_FLIGHT = 4
_STORAGE_DTYPE: dict[str, np.dtype] = {"bfloat16": np.dtype("uint16"), "float32": np.dtype("float32")}
_TS_CONTEXT = ts.Context()


def storage_dtype(logical_dtype: str) -> np.dtype:
    """The numpy dtype that holds `logical_dtype` on disk ('bfloat16' → uint16 bit patterns)."""
    if logical_dtype in _STORAGE_DTYPE:
        return _STORAGE_DTYPE[logical_dtype]
    return np.dtype(logical_dtype)


def torch_logical_dtype(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if dtype not in names:
        raise ValueError(f"tensors of dtype {dtype} cannot be stored; use bfloat16 or float32")
    return names[dtype]


def to_storage(tensor: torch.Tensor, logical_dtype: str) -> np.ndarray:
    """A CPU numpy view of `tensor` in its on-disk representation (no rounding: dtypes must match)."""
    tensor = tensor.detach().cpu().contiguous()
    if torch_logical_dtype(tensor.dtype) != logical_dtype:
        raise ValueError(f"tensor is {tensor.dtype}, the array stores {logical_dtype}")
    if logical_dtype == "bfloat16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_storage(array: np.ndarray, logical_dtype: str) -> torch.Tensor:
    """The torch tensor whose on-disk representation is `array`."""
    array = np.ascontiguousarray(array)
    if logical_dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def chunk_rows(row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk so that a chunk holds about `chunk_bytes`."""
    return max(1, chunk_bytes // max(1, row_bytes))


def create_array(
    path: Path,
    *,
    shape: tuple[int, ...],
    dtype: str,
    chunk_bytes: int,
    codec: str,
    checksum: bool = True,
    attributes: dict[str, Any] | None = None,
) -> zarr.Array:
    """Creates an empty zarr v3 array chunked along its first axis.

    Args:
        dtype: a logical dtype ('bfloat16', 'float32') or a numpy dtype name.
        chunk_bytes: target bytes per chunk; each chunk spans whole rows.
        codec: 'shuffle-zstd1' (blosc byte-shuffle + zstd level 1) or 'none'.
        checksum: end every chunk with its crc32c (format 2; checked on every read).
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    np_dtype = storage_dtype(dtype)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np_dtype.itemsize
    chunks = (min(chunk_rows(row_bytes, chunk_bytes), max(1, shape[0])), *shape[1:])
    compressors: list[Any] = (
        [
            BloscCodec(
                cname="zstd",
                clevel=1,
                shuffle="shuffle",
                typesize=np_dtype.itemsize,
                blocksize=_BLOSC_BLOCK_BYTES,
            )
        ]
        if codec == "shuffle-zstd1"
        else []
    )
    if checksum:
        compressors.append(Crc32cCodec())
    attrs = {"logical_dtype": dtype if dtype in _STORAGE_DTYPE else np_dtype.name, **(attributes or {})}
    return zarr.create_array(
        zarr.storage.LocalStore(path),
        shape=shape,
        chunks=chunks,
        dtype=np_dtype,
        compressors=compressors or None,
        fill_value=0,
        attributes=attrs,
        zarr_format=3,
    )


class ChunkAppender:
    """Fills an array along axis 0 from pieces of any size, writing each chunk exactly once.

    Pieces are buffered until a chunk is full; full chunks are written asynchronously by tensorstore
    with at most a few writes in flight, so the caller (a teacher forward) overlaps with compression
    and disk I/O while memory stays bounded by a few chunks.
    """

    def __init__(self, path: Path, *, total_rows: int) -> None:
        meta = zarr.open_array(zarr.storage.LocalStore(path), mode="r")
        self._rows_per_chunk = meta.chunks[0]
        self._shape = meta.shape
        self._total_rows = total_rows
        self._path = path
        # Every chunk is written, zeros too: a reader can then tell a missing chunk from a zero one.
        self._array = ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(path)},
                "open": True,
                "store_data_equal_to_fill_value": True,
            },
            context=_TS_CONTEXT,
        ).result()
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._written = 0
        self._in_flight: deque[Any] = deque()
        if total_rows != self._shape[0]:
            raise ValueError(f"array has {self._shape[0]} rows, appender was told {total_rows}")

    def append(self, piece: np.ndarray) -> None:
        if piece.shape[1:] != self._shape[1:]:
            raise ValueError(f"piece shape {piece.shape} does not fit array shape {self._shape}")
        if self._written + self._pending_rows + piece.shape[0] > self._total_rows:
            raise ValueError(f"more than the {self._total_rows} rows the array was created for")
        if piece.shape[0]:
            self._pending.append(piece)
            self._pending_rows += piece.shape[0]
        full = (self._pending_rows // self._rows_per_chunk) * self._rows_per_chunk
        if full:
            self._flush(full)

    def _flush(self, num_rows: int) -> None:
        block = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        head, rest = block[:num_rows], block[num_rows:]
        self._pending = [rest] if rest.shape[0] else []
        self._pending_rows = rest.shape[0]
        while len(self._in_flight) >= _MAX_WRITES_IN_FLIGHT:
            self._in_flight.popleft().result()
        start = self._written
        with faults.io("write", self._path):
            self._in_flight.append(self._array[start : start + num_rows].write(np.ascontiguousarray(head)))
        self._written += num_rows

    def close(self) -> None:
        """Writes the last partial chunk and waits until every write has completed."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        with faults.io("write", self._path):
            while self._in_flight:
                self._in_flight.popleft().result()
        if self._written != self._total_rows:
            raise ValueError(f"array filled with {self._written} of its {self._total_rows} rows")


def write_array(
    path: Path,
    data: np.ndarray,
    *,
    logical_dtype: str | None = None,
    chunk_bytes: int,
    codec: str,
    checksum: bool = True,
    attributes: dict[str, Any] | None = None,
) -> None:
    """Creates an array at `path` and writes `data` into it."""
    create_array(
        path,
        shape=data.shape,
        dtype=logical_dtype or data.dtype.name,
        chunk_bytes=chunk_bytes,
        codec=codec,
        checksum=checksum,
        attributes=attributes,
    )
    appender = ChunkAppender(path, total_rows=data.shape[0])
    appender.append(data)
    appender.close()


def write_strings(path: Path, values: list[str], *, checksum: bool = True) -> None:
    """A 1-d array of variable-length UTF-8 strings (zarr-python; small provenance columns only)."""
    array = zarr.create_array(
        zarr.storage.LocalStore(path),
        shape=(len(values),),
        chunks=(max(1, min(len(values), 65536)),),
        dtype=str,
        compressors=[Crc32cCodec()] if checksum else None,
        zarr_format=3,
        config={"write_empty_chunks": True},
    )
    if values:
        with faults.io("write", path):
            array[:] = np.array(values, dtype=object)


def open_array(path: Path) -> zarr.Array:
    """Opens an array read-only with zarr-python (metadata; the string column)."""
    return zarr.open_array(zarr.storage.LocalStore(path, read_only=True), mode="r")
