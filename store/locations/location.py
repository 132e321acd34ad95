"""Where a store's files live: a folder (`folder.Folder`) or a prefix in an object-storage bucket
(`bucket.Bucket`).

Every read and write of a store goes through a `Location`, by key: the file's path inside the store,
'/'-separated. Both keep the commit protocol of DESIGN §4, each with what it offers: a folder renames a
task's fsynced temporary folder onto its name and links records into place, which fails when the name
exists; a bucket uploads a task's files and then its part record with create-only writes, on which a
second writer gets 412. Readers trust only the manifest and the part records, on either.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from mopd.base.errors import ManifestError, StoreIntegrityError
from mopd.base.fsio import object_url

# Ranges of one object closer than this are fetched by one request: a request costs a round trip (tens
# of milliseconds to a remote bucket), which buys megabytes of transfer.
MERGE_GAP = 1 << 20
# Requests in flight at once per process: enough to hide a round trip of ~50 ms behind a step's reads.
REQUESTS_IN_FLIGHT = 32


def join(key: str, name: str) -> str:
    """The key of `name` inside the folder `key` ('' is the store itself)."""
    return f"{key}/{name}" if key else name


class Found(NamedTuple):
    """A file as a `stat` finds it: its size, and an identity that changes whenever it is replaced."""

    size: int
    identity: tuple[Any, ...]


class Location(ABC):
    """The files of one store, by key. `url` names the store in messages."""

    url: str
    # Whether each request costs a network round trip (a bucket): then a reader does not stat a file at
    # every read (its reads are conditional on the version it saw first instead), and verify's quick
    # mode reads each shard's index but not each chunk's 4-byte trailer, a request each.
    remote: bool = False

    def describe(self, key: str) -> str:
        """How a message names the file `key`."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    # Reads.
    @abstractmethod
    def read(self, key: str, where: str, *, limit: int, offset: int = 0, found: Found | None = None) -> bytes:
        """Up to `limit` bytes of `key` from `offset` (`found`: the version a stat saw, which it must
        still be).

        Raises:
            FileNotFoundError: there is no such file.
            StoreIntegrityError: it cannot be read, is a symbolic link, or was replaced since `found`.
        """

    def read_ranges(
        self,
        key: str,
        where: str,
        ranges: Sequence[tuple[int, int]],
        *,
        found: Found | None = None,
    ) -> list[bytes]:
        """The bytes of each (offset, size) range of `key`, in order (on a bucket, close ranges share a
        request: `merged`)."""
        return [self.read(key, where, limit=size, offset=offset, found=found) for offset, size in ranges]

    @abstractmethod
    def stat(self, key: str, where: str, *, missing_ok: bool = False) -> Found | None:
        """The file's size and identity; None when it is absent and that is allowed.

        Raises:
            StoreIntegrityError: it is missing (and that is not allowed), a symbolic link, or unreadable.
        """

    def read_record(self, key: str, what: str, *, limit: int) -> bytes:
        """A record (manifest, plan, part record) whole.

        Raises:
            FileNotFoundError: there is none.
            ManifestError: it is larger than `limit`, a symbolic link, or unreadable.
        """
        where = f"{what} {self.describe(key)}"
        try:
            data = self.read(key, where, limit=limit + 1)
        except StoreIntegrityError as err:
            raise ManifestError(str(err)) from None
        if len(data) > limit:
            raise ManifestError(f"{where}: more than the {limit} bytes a record may have; it is damaged")
        return data

    def exists(self, key: str) -> bool:
        """Whether the file `key` exists."""
        return self.stat(key, key, missing_ok=True) is not None

    @abstractmethod
    def is_folder(self, key: str) -> bool:
        """Whether any file lies below `key`."""

    @abstractmethod
    def listing(self, key: str) -> tuple[dict[str, int], list[str]]:
        """Every file below `key` (path below it → size; temporaries left out) and the symbolic links
        among them (a store never holds one)."""

    @abstractmethod
    def names(self, key: str) -> list[str]:
        """The names directly below `key`, files and folders."""

    @abstractmethod
    def sha256(self, key: str) -> str:
        """The sha256 of the file's bytes."""

    def digests(self, key: str) -> dict[str, tuple[int, str]]:
        """Path below `key` → (size, sha256) of every file below it, sorted by path."""
        files, _links = self.listing(key)
        return {rel: (size, self.sha256(join(key, rel))) for rel, size in sorted(files.items())}

    # Writes: the commit protocol.
    @abstractmethod
    def prepare(self) -> None:
        """Makes the store's place and checks that it refuses a second exclusive create.

        Raises:
            FilesystemError: naming the filesystem or the bucket and what it lacks.
        """

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes, *, what: str = "record") -> bool:
        """Creates `key` with `data` durably, only if it does not exist; True if this call created it."""

    @abstractmethod
    def write_same(self, key: str, data: bytes) -> None:
        """Writes a file whose every version is identical (any writer may write it)."""

    @abstractmethod
    def workspace(self, key: str) -> Path:
        """A new local folder to write the task folder `key` in, this writer's alone."""

    @abstractmethod
    def publish(self, workspace: Path, key: str, *, what: str, record: str) -> bool:
        """Makes the fully written `workspace` the task folder `key` (the workspace is gone after).

        Args:
            record: the key of the task's part record, created after this returns.

        Returns:
            True if published; False if another writer published the task first (its folder is left as it
            is, for the caller to compare).
        """

    def discard(self, workspace: Path) -> None:
        """Removes a workspace that will not be published."""
        shutil.rmtree(workspace, ignore_errors=True)

    def temporaries(self, folders: Iterable[str]) -> list[str]:
        """Keys of temporaries that stopped jobs left in `folders` (a bucket holds none)."""
        return []

    def remove(self, key: str) -> None:  # noqa: B027 - a bucket holds no temporaries to remove
        """Removes the temporary `key`."""

    def local_folder(self) -> Path | None:
        """The store's folder on this machine; None for a bucket."""
        return None

    @abstractmethod
    def machine_cache(self, name: str) -> Path:
        """Where this machine keeps the store's `name` folder for its jobs: inside the store on a filesystem
        (every job of every machine shares it), under this machine's spool (`spool_folder`) for a store in
        a bucket (each machine keeps its own)."""


def spool_folder() -> Path:
    """This machine's workspace for stores in buckets (tasks written before their upload, tokenised rows):
    `MOPD_SPOOL`, or the system's temporary folder."""
    return Path(os.environ.get("MOPD_SPOOL") or tempfile.gettempdir())


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's thread pool `name` (made on first use). Each kind of work has its own, so that work
    in one pool never waits on a pool its own tasks fill."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"mopd-{name}")
        return _POOLS[name]


def merged(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int, list[int]]]:
    """(start, stop, positions of `ranges` inside) of the requests that fetch `ranges` (offset, size):
    ranges closer than `gap` share one."""
    order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
    spans: list[tuple[int, int, list[int]]] = []
    for k in order:
        offset, size = ranges[k]
        if spans and offset - spans[-1][1] < gap:
            start, stop, inside = spans[-1]
            spans[-1] = (start, max(stop, offset + size), [*inside, k])
        else:
            spans.append((offset, offset + size, [k]))
    return spans


def open_location(where: str | Path | Location, options: Mapping[str, str] | None = None) -> Location:
    """The location a store path or URL names (`base.fsio.store_location` spells both); `options` are
    the object-storage client's settings (`store.options`), ignored for a folder."""
    # Here, not at the top: each implementation imports the interface from this module.
    from mopd.store.locations.bucket import Bucket
    from mopd.store.locations.folder import Folder

    if isinstance(where, Location):
        return where
    url = object_url(str(where))
    return Folder(where) if url is None else Bucket(url, options)
