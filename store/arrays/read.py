"""Verified reads of the store's arrays, chunk by chunk: mopd reads, checks and decodes each chunk itself,
and refuses any that is not the file the store recorded (docs/internals.md, store/arrays/read.py).
"""

from __future__ import annotations

import functools
import json
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

from mopd.base.errors import StoreIntegrityError
from mopd.base.jsonio import MAX_RECORD_BYTES, parse_json
from mopd.store.arrays.binding import COPIED, CRC_FILE, Recorded
from mopd.store.locations.location import Found, Location, join, open_location, shared_pool

# crc32c(data + its crc32c as 4 little-endian bytes) is this constant for any data: a chunk is
# checked in one pass over its bytes, trailer included, with no copy.
_CRC32C_RESIDUE = 0x48674BC7
_CODEC_CHAINS = {
    ("bytes",): (False, False),
    ("bytes", "crc32c"): (False, True),
    ("bytes", "blosc"): (True, False),
    ("bytes", "blosc", "crc32c"): (True, True),
}
CACHE_BYTES = 256 << 20  # decoded chunks a ChunkCache keeps for reuse, over all arrays of its store
INDEX_CACHE_BYTES = 64 << 20  # shard indexes it keeps: ~4M inner chunks, a store of ~1 TB at 256 KiB


_INDEX_CODECS = (("bytes", "little"), ("crc32c", None))
_NO_CHUNK = 2**64 - 1  # a shard index entry for a chunk that was never written


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the unit of decoding: the inner chunk of a sharded array
    dtype: np.dtype
    blosc: bool
    checksum: bool
    logical_dtype: str
    chunks_per_shard: int | None  # None: one file per chunk


def chunk_name(index: int, ndim: int) -> str:
    """The file of chunk (or shard) `index` along axis 0 under the default key encoding, inside its array."""
    return "/".join(("c", str(index), *("0" for _ in range(ndim - 1))))


def _codec_chain(codecs: list[dict[str, Any]]) -> tuple[tuple[str, ...], str]:
    chain = tuple(c["name"] for c in codecs)
    endian = next(c.get("configuration", {}).get("endian", "little") for c in codecs if c["name"] == "bytes")
    return chain, endian


def array_header(location: Location, key: str, label: str) -> tuple[tuple[int, ...], str, bytes]:
    """(shape, zarr data type, the file's bytes) from the zarr.json of the array at `path`: what
    `verify-manifest` checks of every array, read without opening it (a store of 10k shards holds 30k
    of them, most of them byte-identical: each distinct header is parsed once).

    Raises:
        FileNotFoundError: there is no zarr.json.
        StoreIntegrityError: it cannot be read, or is not an array's.
    """
    data = _header_bytes(location, key, label)
    try:
        return (*_parse_header(data), data)
    except StoreIntegrityError as err:
        raise StoreIntegrityError(f"{label}/{err}") from err


def check_recorded_chunks(
    location: Location, key: str, label: str, recorded: Recorded, header: bytes
) -> None:
    """Without decoding a chunk: the array's zarr.json (`header`), shard index and every chunk's checksum
    are the ones its part record lists (format 4; what the default `verify-manifest` checks of each
    array). One read of the list, one of the shard's index and one of the chunks' trailers, the shard's
    size coming from the record. In a bucket the trailers are left to the reads, which check each chunk
    they decode, and to `--full`: a request each would cost more than reading the shard.

    Raises:
        StoreIntegrityError: naming the file and the first chunk that differs.
    """
    recorded.check("zarr.json", header, f"{label}/zarr.json")
    shard = next((rel for rel in recorded.files if rel.startswith("c/")), None)
    if shard is None:
        return  # an array of no rows has no shard, and no list
    where = f"{label}/{CRC_FILE}"
    try:
        crcs = location.read(join(key, CRC_FILE), where, limit=recorded.files.get(CRC_FILE, (0,))[0] + 1)
    except FileNotFoundError:
        raise StoreIntegrityError(f"{where} is missing; the store is damaged") from None
    recorded.check(CRC_FILE, crcs, where)
    chunks, size = len(crcs) // 4 - 1, recorded.files[shard][0]
    file = join(key, shard)
    where = f"{label}: shard ({location.describe(file)})"
    index_bytes = 16 * chunks + 4
    try:
        raw = location.read(file, where, limit=index_bytes, offset=max(0, size - index_bytes))
    except FileNotFoundError:
        raise StoreIntegrityError(f"{where} is missing") from None
    if len(raw) != index_bytes or raw[-4:] != crcs[-4:] or google_crc32c.value(raw) != _CRC32C_RESIDUE:
        raise StoreIntegrityError(f"{where}: its index is not the one the store recorded ({COPIED})")
    entries = np.frombuffer(raw[:-4], dtype="<u8").reshape(chunks, 2)
    ends = entries[:, 0] + entries[:, 1]
    if (entries[:, 0] == _NO_CHUNK).any() or (ends > size - index_bytes).any():
        raise StoreIntegrityError(f"{where}: its index lists a chunk that is not there")
    if location.remote:  # see above
        return
    trailers = b"".join(location.read_ranges(file, where, [(at + n - 4, 4) for at, n in entries.tolist()]))
    differ = np.flatnonzero(np.frombuffer(trailers, "<u4") != np.frombuffer(crcs[:-4], "<u4"))
    if differ.size:
        raise StoreIntegrityError(
            f"{label}: chunk {int(differ[0])} ({location.describe(file)}) is not the chunk the store "
            f"recorded ({differ.size} of {chunks} differ: {COPIED})"
        )


def _header_bytes(location: Location, key: str, label: str) -> bytes:
    """The bytes of the array's zarr.json (at most one past the record limit, which parsing refuses).

    Raises:
        FileNotFoundError: there is no zarr.json.
        StoreIntegrityError: it cannot be read, or is a symbolic link.
    """
    return location.read(join(key, "zarr.json"), f"{label}/zarr.json", limit=MAX_RECORD_BYTES + 1)


@functools.lru_cache(maxsize=4096)
def _parse_header(data: bytes) -> tuple[tuple[int, ...], str]:
    meta = parse_json(data, what="zarr.json", error=StoreIntegrityError)
    try:
        return tuple(int(n) for n in meta["shape"]), str(meta["data_type"])
    except (KeyError, TypeError, ValueError) as err:
        raise StoreIntegrityError(f"zarr.json: not an array ({err!r})") from err


def _layout(location: Location, key: str, label: str, recorded: Recorded | None) -> _Layout:
    """The array's layout from its zarr.json (the recorded one, if given), refusing any layout mopd does
    not write."""
    meta = _header(location, key, label, recorded)
    try:
        shape = tuple(int(n) for n in meta["shape"])
        grid = meta["chunk_grid"]
        keys = meta.get("chunk_key_encoding", {"name": "default"})
        outer_shape = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        chunk_shape, chunks_per_shard, codecs = _chunking(meta["codecs"], shape, outer_shape)
        chain, endian = _codec_chain(codecs)
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        usable = (
            grid["name"] == "regular"
            and keys["name"] == "default"
            and keys.get("configuration", {}).get("separator", "/") == "/"
            and chain in _CODEC_CHAINS
            and endian == "little"
            and chunks_per_shard != 0
        )
        attrs = meta.get("attributes", {})
    except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError) as err:
        raise StoreIntegrityError(f"{label}/zarr.json: not an array mopd wrote ({err!r})") from err
    if not usable or chunk_shape[1:] != shape[1:] or chunk_shape[0] <= 0:  # chunks of whole rows
        raise StoreIntegrityError(f"{label}/zarr.json: a chunk layout or codec chain mopd does not write")
    compressed, checksum = _CODEC_CHAINS[chain]
    return _Layout(
        shape=shape,
        chunk_shape=chunk_shape,
        dtype=dtype,
        blosc=compressed,
        checksum=checksum,
        logical_dtype=str(attrs.get("logical_dtype", dtype.name)),
        chunks_per_shard=chunks_per_shard,
    )


def _header(location: Location, key: str, label: str, recorded: Recorded | None) -> Any:
    """The array's zarr.json, parsed: given the part record's entry, first proved to be the recorded file
    (a plain parse then suffices), else parsed as untrusted JSON."""
    try:
        data = _header_bytes(location, key, label)
    except FileNotFoundError:
        raise StoreIntegrityError(f"{label}: the array's zarr.json is missing") from None
    if recorded is None:
        return parse_json(data, what=f"{label}/zarr.json", error=StoreIntegrityError)
    recorded.check("zarr.json", data, f"{label}/zarr.json")
    return json.loads(data)


def _chunking(
    codecs: Any, shape: tuple[int, ...], outer_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], int | None, Any]:
    """(the chunk a read decodes, inner chunks per shard, the chunk's codecs) of an array's codecs: a
    shard as mopd writes it (its index at the end, one shard the whole array; 0 inner chunks for one
    written otherwise, which the caller refuses), or one file per chunk (None)."""
    if not (len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed"):
        return outer_shape, None, codecs
    sharding = codecs[0]["configuration"]
    chunk_shape = tuple(int(n) for n in sharding["chunk_shape"])
    index_chain = tuple(
        (c["name"], c.get("configuration", {}).get("endian")) for c in sharding["index_codecs"]
    )
    as_written = (
        index_chain == _INDEX_CODECS
        and sharding.get("index_location", "end") == "end"
        and outer_shape[1:] == chunk_shape[1:]
        and outer_shape[0] % chunk_shape[0] == 0
        and outer_shape[0] >= shape[0]  # one shard holds the whole array
    )
    return chunk_shape, outer_shape[0] // chunk_shape[0] if as_written else 0, sharding["codecs"]


class _BoundedCache:
    """A byte-bounded LRU of decoded arrays (chunks, shard indexes) shared by the process (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._chunks: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> np.ndarray | None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
            return chunk

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._held = 0

    def put(self, key: tuple[Any, ...], chunk: np.ndarray) -> None:
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


class ChunkCache:
    """The decoded chunks and shard indexes (16 bytes per inner chunk) that the readers of one store share,
    each bounded (`CACHE_BYTES`, `INDEX_CACHE_BYTES`) and keyed by its file's identity: a chunk or shard
    deleted, replaced or changed since it was decoded is read again, never served from memory. A store
    owns one (`TeacherStore.cache`), a lone reader its own; it lives as long as they do."""

    def __init__(self) -> None:
        self.chunks = _BoundedCache(CACHE_BYTES)
        self.indexes = _BoundedCache(INDEX_CACHE_BYTES)

    def clear(self) -> None:
        """Drops what it keeps (its memory, or a cold start for a count of chunk reads)."""
        self.chunks.clear()
        self.indexes.clear()


def _pool() -> ThreadPoolExecutor:
    """Decoding releases the GIL: every core decodes a read's chunks."""
    return shared_pool("chunks", os.cpu_count() or 1)


class ArrayReader:
    """Reads rows of one stored array, refusing anything that is not the stored data.

    Args:
        location: the store (or, for a lone array, its folder).
        key: the array's folder inside it.
        label: how messages name it (its path inside the store).
        recorded: the array's files as its part record lists them; every file read is then proved to be
            the recorded one (see `binding.py`).
        cache: where decoded chunks are kept for reuse (its store's); a cache of its own if None.
    """

    def __init__(
        self,
        location: Location | Path,
        key: str = "",
        *,
        label: str,
        recorded: Recorded | None = None,
        cache: ChunkCache | None = None,
    ) -> None:
        self.location = open_location(location)
        self.key = key
        self.label = label
        self._recorded = recorded
        self._cache = cache or ChunkCache()
        self._layout = _layout(self.location, key, label, recorded)
        self.shape = self._layout.shape
        self.logical_dtype = self._layout.logical_dtype
        self._chunk_rows = self._layout.chunk_shape[0]
        self._crcs: np.ndarray | None = None  # each inner chunk's crc32c, then the index's
        self._shard_found: Found | None = None  # a bucket's shard as first seen: reads must find it so

    def _decode(self, index: int, data: bytes, where: str) -> np.ndarray:
        """Chunk `index` from its stored bytes, checksum first."""
        layout = self._layout
        if layout.checksum:
            if len(data) < 4 or google_crc32c.value(data) != _CRC32C_RESIDUE:
                raise StoreIntegrityError(f"{where} fails its crc32c checksum (changed or truncated)")
            if self._crcs is not None and int.from_bytes(data[-4:], "little") != self._crcs[index]:
                raise StoreIntegrityError(f"{where} is not the chunk the store recorded ({COPIED})")
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

    def _file_stat(self, name: str, where: str) -> Found:
        """The chunk or shard file `name` of this array (`Location.stat`), at its recorded size."""
        found = self.location.stat(join(self.key, name), where)
        assert found is not None  # a missing file raises
        if self._recorded is not None:
            self._recorded.check_size(name, found.size, where)
        return found

    def _where(self, name: str, index: int | None) -> str:
        what = "shard" if index is None else f"chunk {index}"
        return f"{self.label}: {what} ({self.location.describe(join(self.key, name))})"

    def _chunks(self, indices: list[int]) -> list[np.ndarray]:
        """Chunks `indices`, each from the cache or read and decoded (in parallel when there are several).

        The file's identity is part of every cache key: a chunk or shard deleted, replaced or changed
        since it was decoded is read again (and refused), never served from memory.
        """
        if self._layout.chunks_per_shard is None:
            chunks = (
                map(self._file_chunk, indices)
                if len(indices) == 1
                else _pool().map(self._file_chunk, indices)
            )
            return list(chunks)
        name, identity, entries = self._shard_index()
        keys = [(self.location.url, self.key, index, *identity) for index in indices]
        out: list[np.ndarray | None] = [self._cache.chunks.get(key) for key in keys]
        wanted = [k for k, chunk in enumerate(out) if chunk is None]
        ranges = []
        for k in wanted:
            offset, nbytes = (int(n) for n in entries[indices[k]])
            if offset == _NO_CHUNK:
                where = self._where(name, indices[k])
                raise StoreIntegrityError(f"{where} is missing: the shard index lists no such chunk")
            ranges.append((offset, nbytes))
        where = self._where(name, None)
        try:
            data = self.location.read_ranges(join(self.key, name), where, ranges, found=self._shard_found)
        except FileNotFoundError:
            raise StoreIntegrityError(f"{where} is missing") from None

        def decode(k: int, raw: bytes) -> np.ndarray:
            chunk = self._decode(indices[k], raw, self._where(name, indices[k]))
            self._cache.chunks.put(keys[k], chunk)
            return chunk

        decode_all = _pool().map if len(wanted) > 1 else map
        for k, chunk in zip(wanted, list(decode_all(decode, wanted, data)), strict=True):
            out[k] = chunk
        return [chunk for chunk in out if chunk is not None]

    def _file_chunk(self, index: int) -> np.ndarray:
        """Chunk `index` of an array of one file per chunk (the layout before shards, which
        `bench/scale.py` measures against)."""
        name = chunk_name(index, len(self.shape))
        where = self._where(name, index)
        found = self._file_stat(name, where)
        key = (self.location.url, self.key, index, *found.identity)
        chunk = self._cache.chunks.get(key)
        if chunk is None:
            data = self._read(name, where, found.size, 0, found)
            chunk = self._decode(index, data, where)
            self._cache.chunks.put(key, chunk)
        return chunk

    def _shard_index(self) -> tuple[str, tuple[Any, ...], np.ndarray]:
        """The shard file (one per array), its identity and its verified index ([chunks, 2]: offset,
        size), read once."""
        name = chunk_name(0, len(self.shape))
        where = self._where(name, None)
        found = self._shard_found
        if found is None or not self.location.remote:
            found = self._file_stat(name, where)
            if self.location.remote:
                self._shard_found = found
        key = (self.location.url, self.key, *found.identity)
        entries = self._cache.indexes.get(key)
        per_shard = self._layout.chunks_per_shard
        assert per_shard is not None
        if self._recorded is not None and self._crcs is None:
            self._crcs = self._chunk_crcs(per_shard)
        if entries is None:
            index_bytes = 16 * per_shard + 4
            if found.size < index_bytes:
                raise StoreIntegrityError(f"{where} is truncated: shorter than its shard index")
            raw = self._read(name, where, index_bytes, found.size - index_bytes, found)
            if google_crc32c.value(raw) != _CRC32C_RESIDUE:
                raise StoreIntegrityError(
                    f"{where}: its shard index fails its crc32c checksum (changed or truncated)"
                )
            if self._crcs is not None and int.from_bytes(raw[-4:], "little") != self._crcs[-1]:
                raise StoreIntegrityError(f"{where}: its shard index is not the one the store recorded")
            entries = np.frombuffer(raw[:-4], dtype="<u8").reshape(per_shard, 2)
            written = entries[:, 0] != _NO_CHUNK
            ends = entries[written, 0] + entries[written, 1]
            if ends.size and int(ends.max()) > found.size - index_bytes:
                raise StoreIntegrityError(f"{where}: its index points past the chunk data (truncated)")
            self._cache.indexes.put(key, entries)
        return name, found.identity, entries

    def _read(self, name: str, where: str, limit: int, offset: int, found: Found) -> bytes:
        """`limit` bytes of the array's file `name` from `offset`, still the version `found`."""
        try:
            return self.location.read(join(self.key, name), where, limit=limit, offset=offset, found=found)
        except FileNotFoundError:
            raise StoreIntegrityError(f"{where} is missing") from None

    def _chunk_crcs(self, per_shard: int) -> np.ndarray:
        """The recorded crc32c of each inner chunk and of the shard index, from `CRC_FILE`."""
        where = f"{self.label}/{CRC_FILE}"
        try:
            data = self.location.read(join(self.key, CRC_FILE), where, limit=4 * (per_shard + 1) + 1)
        except FileNotFoundError:
            raise StoreIntegrityError(f"{where} is missing; the store is damaged") from None
        assert self._recorded is not None
        self._recorded.check(CRC_FILE, data, where)
        if len(data) != 4 * (per_shard + 1):
            raise StoreIntegrityError(f"{where} lists {len(data) // 4} checksums, not {per_shard + 1}")
        return np.frombuffer(data, dtype="<u4")

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
        # Where each chunk's rows go: (position in out, first and last row inside the chunk).
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        at = 0
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            for index in range(start // rows, (stop - 1) // rows + 1) if stop > start else ():
                first, last = max(start, index * rows), min(stop, (index + 1) * rows)
                pieces.setdefault(index, []).append((at, first - index * rows, last - index * rows))
                at += last - first
        indices = sorted(pieces)
        for index, chunk in zip(indices, self._chunks(indices), strict=True):
            for at, first, last in pieces[index]:
                out[at : at + last - first] = chunk[first:last]
        return out
