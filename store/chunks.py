"""Verified reads of the store's arrays, chunk by chunk: mopd reads, checks and decodes each chunk file
itself.

Every array mopd writes is a zarr v3 array of one shape: a regular grid along the first axis, the
default chunk key encoding (`c/<i>/0/…`), and the codec chain bytes (little endian) → blosc (optional)
→ crc32c (format 2). Reading those files directly instead of through a general zarr library pays off
twice. The crc32c runs on the CPU's own instruction (google-crc32c, ~25 GB/s here); tensorstore's
portable wheel computes it in software, which cost 20–30% of the read time (`bench/store_io.py`). And a
decoded chunk is kept in a small LRU cache, so the rows inside one chunk decode it once, not once each.

A chunk that is missing, of the wrong size, fails its checksum or does not decode is a
`StoreIntegrityError` naming the array, the chunk and the file: nothing is ever filled in, except the
all-zero chunks that format 1 did not write (`fill_missing`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import blosc

from mopd.store.errors import StoreIntegrityError
from mopd.store.jsonio import parse_json

# crc32c(data + its crc32c as 4 little-endian bytes) is this constant for any data: a chunk is
# checked in one pass over its bytes, trailer included, with no copy.
_CRC32C_RESIDUE = 0x48674BC7
_CODEC_CHAINS = {
    ("bytes",): (False, False),
    ("bytes", "crc32c"): (False, True),
    ("bytes", "blosc"): (True, False),
    ("bytes", "blosc", "crc32c"): (True, True),
}
CACHE_BYTES = 256 << 20  # decoded chunks kept for reuse, over all arrays of the process


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    blosc: bool
    checksum: bool
    fill_value: Any
    logical_dtype: str


def _layout(path: Path, label: str) -> _Layout:
    """The array's layout from its zarr.json, refusing any layout mopd does not write."""
    try:
        data = (path / "zarr.json").read_bytes()
    except OSError as err:
        raise StoreIntegrityError(f"{label}: the array's zarr.json cannot be read ({err.strerror})") from err
    meta = parse_json(data, what=f"{label}/zarr.json", error=StoreIntegrityError)
    try:
        shape = tuple(int(n) for n in meta["shape"])
        grid = meta["chunk_grid"]
        keys = meta.get("chunk_key_encoding", {"name": "default"})
        codecs = meta["codecs"]
        chain = tuple(c["name"] for c in codecs)
        endian = next(
            c.get("configuration", {}).get("endian", "little") for c in codecs if c["name"] == "bytes"
        )
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        usable = (
            grid["name"] == "regular"
            and keys["name"] == "default"
            and keys.get("configuration", {}).get("separator", "/") == "/"
            and chain in _CODEC_CHAINS
            and endian == "little"
        )
        chunk_shape = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        attrs = meta.get("attributes", {})
    except (KeyError, TypeError, ValueError, StopIteration) as err:
        raise StoreIntegrityError(f"{label}/zarr.json: not an array mopd wrote ({err!r})") from err
    if not usable or chunk_shape[1:] != shape[1:]:  # chunks of whole rows
        raise StoreIntegrityError(f"{label}/zarr.json: a chunk layout or codec chain mopd does not write")
    compressed, checksum = _CODEC_CHAINS[chain]
    return _Layout(
        shape=shape,
        chunk_shape=chunk_shape,
        dtype=dtype,
        blosc=compressed,
        checksum=checksum,
        fill_value=meta.get("fill_value", 0),
        logical_dtype=str(attrs.get("logical_dtype", dtype.name)),
    )


class _DecodedChunks:
    """A byte-bounded LRU of decoded chunks shared by every reader of the process (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._chunks: OrderedDict[tuple[str, int, int, int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, int, int, int]) -> np.ndarray | None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
            return chunk

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._held = 0

    def put(self, key: tuple[str, int, int, int, int], chunk: np.ndarray) -> None:
        if chunk.nbytes > self._limit:
            return
        with self._lock:
            if key in self._chunks:
                return
            self._chunks[key] = chunk
            self._held += chunk.nbytes
            while self._held > self._limit:
                _, dropped = self._chunks.popitem(last=False)
                self._held -= dropped.nbytes


_CACHE = _DecodedChunks(CACHE_BYTES)
_POOL: ThreadPoolExecutor | None = None


def clear_cache() -> None:
    """Drops every decoded chunk the process keeps (their memory, or a fresh count of chunk reads)."""
    _CACHE.clear()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="mopd-chunks")
    return _POOL


class ArrayReader:
    """Reads rows of one stored array, refusing anything that is not the stored data.

    Args:
        path: the array's folder.
        label: how messages name it (its path inside the store).
        fill_missing: take an absent chunk as all fill value. Only for format-1 arrays, which skipped
            all-zero chunks; their readers check the chunk files against the part records instead.
    """

    def __init__(self, path: Path, *, label: str, fill_missing: bool = False) -> None:
        self.path = path
        self.label = label
        self._layout = _layout(path, label)
        self._fill_missing = fill_missing
        self.shape = self._layout.shape
        self.logical_dtype = self._layout.logical_dtype
        self._chunk_rows = self._layout.chunk_shape[0]

    def _chunk_file(self, index: int) -> Path:
        return self.path.joinpath("c", str(index), *("0" for _ in self.shape[1:]))

    def _decode(self, index: int) -> np.ndarray:
        layout, file = self._layout, self._chunk_file(index)
        where = f"{self.label}: chunk {index} ({file})"
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            if self._fill_missing:
                return np.full(layout.chunk_shape, layout.fill_value, dtype=layout.dtype)
            raise StoreIntegrityError(f"{where} is missing") from None
        except OSError as err:
            raise StoreIntegrityError(f"{where} cannot be read ({err.strerror})") from err
        if layout.checksum:
            if len(data) < 4 or google_crc32c.value(data) != _CRC32C_RESIDUE:
                raise StoreIntegrityError(f"{where} fails its crc32c checksum (changed or truncated)")
            payload = memoryview(data)[:-4]
        else:
            payload = memoryview(data)
        chunk = np.empty(layout.chunk_shape, dtype=layout.dtype)
        if layout.blosc:
            try:
                blosc.decompress(payload, chunk)
            except Exception as err:  # numcodecs raises RuntimeError or ValueError on a bad buffer
                raise StoreIntegrityError(f"{where} does not decode ({err})") from err
        elif payload.nbytes == chunk.nbytes:
            chunk.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
        else:
            raise StoreIntegrityError(f"{where} holds {payload.nbytes} bytes, a chunk {chunk.nbytes}")
        return chunk

    def _chunk(self, index: int) -> np.ndarray:
        # The file's identity is part of the key: a chunk deleted, replaced or changed since it was
        # decoded is read again (and refused), never served from memory.
        try:
            stat = self._chunk_file(index).stat()
        except OSError:
            return self._decode(index)  # missing: refused, or filled in for format 1
        key = (str(self.path), index, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        chunk = _CACHE.get(key)
        if chunk is None:
            chunk = self._decode(index)
            _CACHE.put(key, chunk)
        return chunk

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in their on-disk representation (reads only the chunks they overlap).

        Raises:
            StoreIntegrityError: a chunk of the range is missing, truncated, undecodable or fails its
                checksum (the message names the array, the chunk and the file).
        """
        stop = self.shape[0] if stop is None else min(stop, self.shape[0])
        if stop <= start:
            return np.empty((0, *self.shape[1:]), dtype=self._layout.dtype)
        return self.gather(np.array([start]), np.array([stop]))

    def gather(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """The row ranges [starts[k], stops[k]) end to end, each chunk they touch decoded at most once.

        The loader's read: a microbatch's rows lie in few chunks, and every range of one call is cut
        from the same decoded chunks (decoded in parallel when there are several).

        Raises:
            StoreIntegrityError: as `read`.
            IndexError: a range reaches past the array.
        """
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        if starts.size and (starts.min() < 0 or stops.max() > self.shape[0] or (stops < starts).any()):
            raise IndexError(f"{self.label}: a range outside [0, {self.shape[0]})")
        out = np.empty((int((stops - starts).sum()), *self.shape[1:]), dtype=self._layout.dtype)
        rows = self._chunk_rows
        ranges = list(zip(starts.tolist(), stops.tolist(), strict=True))
        spans = [range(start // rows, (stop - 1) // rows + 1) for start, stop in ranges if stop > start]
        indices = sorted({index for span in spans for index in span})
        decoded = map(self._chunk, indices) if len(indices) == 1 else _pool().map(self._chunk, indices)
        chunks = dict(zip(indices, decoded, strict=True))
        at = 0
        for start, stop in ranges:
            for index in range(start // rows, (stop - 1) // rows + 1) if stop > start else ():
                first, last = max(start, index * rows), min(stop, (index + 1) * rows)
                out[at : at + last - first] = chunks[index][first - index * rows : last - index * rows]
                at += last - first
        return out
