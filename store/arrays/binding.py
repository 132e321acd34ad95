"""Each file a reader reads proved to be the file the store recorded.

A chunk's crc32c proves only that the chunk is self-consistent: a same-shape file copied in from another
store passes it. What binds a file to its place is its part record (itself proved by the manifest's
sha256 of it), which lists every file of a task folder with its size and sha256. Hashing a shard at
every open would cost a second read of the store, so mopd writes beside each shard `CRC_FILE`, the
crc32c of each of its inner chunks and then of its shard index: a small file whose size and sha256 the
part record holds. A reader compares each chunk's 4-byte trailer, which it holds anyway, with the listed
one (`read.ArrayReader`); `verify-manifest` compares all of them without decoding a chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from mopd.base.errors import StoreIntegrityError

# Beside an array's shard, the crc32c of each inner chunk and then of the shard index, each 4
# bytes little endian, in the order of the index.
CRC_FILE = "chunks.crc32c"
COPIED = "a file copied from elsewhere, or changed; `mopd verify-manifest` lists every such file"


@dataclass(frozen=True)
class Recorded:
    """What the store's part record says of one array: its files (path inside the array's folder →
    size, sha256), `CRC_FILE` among them."""

    files: Mapping[str, tuple[int, str]]

    @classmethod
    def of(cls, files: Mapping[str, tuple[int, str]], name: str) -> Recorded:
        """The files of array `name` ('': the task folder is the array) among a part record's."""
        if not name:
            return cls(files)
        prefix = f"{name}/"
        return cls({k[len(prefix) :]: v for k, v in files.items() if k.startswith(prefix)})

    def check(self, rel: str, data: bytes, where: str) -> None:
        """`data`, the bytes of the array's file `rel`, are the ones the part record lists.

        Raises:
            StoreIntegrityError: they are not.
        """
        size, digest = self.files.get(rel, (None, None))
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise StoreIntegrityError(f"{where} is not the file the store recorded ({COPIED})")

    def check_size(self, rel: str, found: int, where: str) -> None:
        """The array's file `rel` holds `found` bytes, as the part record lists.

        Raises:
            StoreIntegrityError: it does not.
        """
        size = self.files.get(rel, (None,))[0]
        if found != size:
            raise StoreIntegrityError(f"{where} holds {found} bytes, the store recorded {size} ({COPIED})")
