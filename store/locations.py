"""Where a store's files live: a folder (`Folder`) or a prefix in an object-storage bucket (`Bucket`).

Every read and write of a store goes through a `Location`, by key: the file's path inside the store,
'/'-separated. The two keep the same commit protocol (DESIGN §4) with what each offers:

- a folder publishes a task by renaming its fsynced temporary folder onto the task's name, and creates
  records with `os.link`, which fails when the name exists (`base/fsio.py`);
- a bucket has no rename: a task's files are written in a local workspace, then uploaded to their names
  with create-only writes (`If-None-Match: *`), and the part record is created last the same way, so a
  second writer gets 412 and takes the task as done by another job. Objects of a task without a part
  record are not part of the store: a rerun writes over them, each write conditional on the version it
  found (`If-Match`). Readers trust only the manifest and the part records, as on a folder.

Reads of a bucket are byte ranges: the ranges one read needs are merged where they lie close together
and the merged requests run concurrently, each conditional on the object's version when the reader first
saw it, so that a replaced object is refused instead of mixed with the one it replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, cast

from mopd.base import faults
from mopd.base.errors import ConfigError, FilesystemError, ManifestError, StoreIntegrityError
from mopd.base.fsio import (
    LINK_REFUSED,
    create_exclusive,
    is_temporary,
    object_url,
    probe_filesystem,
    publish_dir,
    sha256_file,
    unique_temp_name,
    write_replace,
)

# Ranges of one object closer than this are fetched by one request: a request costs a round trip (tens
# of milliseconds to a remote bucket), which buys megabytes of transfer.
MERGE_GAP = 1 << 20
# Requests in flight at once per process: enough to hide a round trip of ~50 ms behind a step's reads.
REQUESTS_IN_FLIGHT = 32
_HASH_BLOCK = 8 << 20


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
    # Whether a reader stats a file at every read to see that it was not replaced (cheap on a folder);
    # a bucket's reads are conditional on the version seen first instead.
    stat_each_read: bool = True

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
        gap: int = MERGE_GAP,
    ) -> list[bytes]:
        """The bytes of each (offset, size) range of `key`, in order; on a bucket, ranges closer than `gap`
        share a request."""
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


class Folder(Location):
    """A store in a folder of a local or shared POSIX filesystem; nothing in it is read through a link."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = str(root)
        self._checked: set[str] = set()  # keys of folders proved not to be links

    def _path(self, key: str, where: str) -> Path:
        """The file of `key`, its folders below the root checked (once) not to be links."""
        parts = key.split("/")
        for depth in range(1, len(parts)):
            prefix = "/".join(parts[:depth])
            if prefix not in self._checked:
                if os.path.islink(os.path.join(self.root, prefix)):
                    raise StoreIntegrityError(f"{where}: {prefix} is {LINK_REFUSED}")
                self._checked.add(prefix)
        return self.root / key

    def read(self, key: str, where: str, *, limit: int, offset: int = 0, found: Found | None = None) -> bytes:
        file = self._path(key, where)
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise
        except OSError as err:
            if os.path.islink(file):
                raise StoreIntegrityError(f"{where}: {LINK_REFUSED}") from None
            raise StoreIntegrityError(f"{where} cannot be read ({err.strerror})") from err
        try:
            return os.pread(fd, limit, offset)
        except OSError as err:
            raise StoreIntegrityError(f"{where} cannot be read ({err.strerror})") from err
        finally:
            os.close(fd)

    def stat(self, key: str, where: str, *, missing_ok: bool = False) -> Found | None:
        try:
            found = self._path(key, where).lstat()
        except FileNotFoundError:
            if missing_ok:
                return None
            raise StoreIntegrityError(f"{where} is missing") from None
        except OSError as err:
            raise StoreIntegrityError(f"{where} cannot be read ({err.strerror})") from err
        if stat.S_ISLNK(found.st_mode):
            raise StoreIntegrityError(f"{where}: {LINK_REFUSED}")
        return Found(found.st_size, (found.st_ino, found.st_size, found.st_mtime_ns))

    def is_folder(self, key: str) -> bool:
        return (self.root / key).is_dir()

    def listing(self, key: str) -> tuple[dict[str, int], list[str]]:
        # One scandir per folder, on plain strings (a store of 10k shards holds 80k folders).
        found: dict[str, int] = {}
        links: list[str] = []
        pending = [("", os.path.join(self.root, key))]
        while pending:
            prefix, current = pending.pop()
            with os.scandir(current) as entries:
                for entry in entries:
                    rel = prefix + entry.name
                    if is_temporary(entry.name):
                        continue
                    if entry.is_symlink():
                        links.append(rel)
                    elif entry.is_dir():
                        pending.append((rel + "/", entry.path))
                    else:
                        found[rel] = entry.stat().st_size
        return found, links

    def names(self, key: str) -> list[str]:
        try:
            return sorted(os.listdir(self.root / key))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sha256(self, key: str) -> str:
        return sha256_file(self.root / key)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        probe_filesystem(self.root)

    def create_exclusive(self, key: str, data: bytes, *, what: str = "record") -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        return create_exclusive(path, data, what=what)

    def write_same(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            write_replace(path, data)

    def workspace(self, key: str) -> Path:
        temp = unique_temp_name(self.root / key)
        temp.mkdir(parents=True)
        return temp

    def publish(self, workspace: Path, key: str, *, what: str, record: str) -> bool:
        return publish_dir(workspace, self.root / key, what=what)

    def temporaries(self, folders: Iterable[str]) -> list[str]:
        found = []
        for folder in sorted(set(folders)):
            try:
                with os.scandir(self.root / folder) as entries:
                    found += [
                        f"{folder}/{e.name}".lstrip("/")
                        for e in entries
                        if is_temporary(e.name) and not e.is_symlink()
                    ]
            except (FileNotFoundError, NotADirectoryError):
                continue
        return sorted(found)

    def remove(self, key: str) -> None:
        path = self.root / key
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def local_folder(self) -> Path:
        return self.root


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


class Bucket(Location):
    """A store under a prefix of an object-storage bucket (`s3://bucket/prefix`, `gs://…`), through
    obstore. Endpoint, region and credentials come from the environment (`AWS_ENDPOINT_URL`,
    `AWS_REGION`, `AWS_ACCESS_KEY_ID`…, or `GOOGLE_…` for gs://) and from `options` (obstore's settings,
    e.g. `endpoint`, `region`, `allow_http`)."""

    stat_each_read = False

    def __init__(self, url: str, options: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.options = dict(options or {})
        self._store: Any = None
        self.spool = Path(os.environ.get("MOPD_SPOOL") or tempfile.gettempdir())

    def __getstate__(self) -> dict[str, Any]:  # a verify worker opens its own client
        return {**self.__dict__, "_store": None}

    @property
    def store(self) -> Any:
        if self._store is None:
            try:
                from obstore.store import from_url
            except ModuleNotFoundError:
                raise ConfigError(
                    f"store {self.url}: object storage needs obstore; pip install 'mopd[object-storage]'"
                ) from None

            try:
                self._store = from_url(self.url, config=cast(Any, self.options) or None)
            except Exception as err:  # obstore's own error type for a bad URL or setting
                raise ConfigError(f"store {self.url}: {err}") from err
        return self._store

    def _errors(self, err: Exception, where: str) -> Exception:
        """A mopd error for obstore's `err` (a missing object is a FileNotFoundError already)."""
        return StoreIntegrityError(f"{where} cannot be read ({type(err).__name__}: {_first_line(err)})")

    def read(self, key: str, where: str, *, limit: int, offset: int = 0, found: Found | None = None) -> bytes:
        return self.read_ranges(key, where, [(offset, limit)], found=found)[0]

    def read_ranges(
        self,
        key: str,
        where: str,
        ranges: Sequence[tuple[int, int]],
        *,
        found: Found | None = None,
        gap: int = MERGE_GAP,
    ) -> list[bytes]:
        import obstore
        from obstore.exceptions import PreconditionError

        options: dict[str, Any] = {"if_match": found.identity[0]} if found is not None else {}

        def fetch(span: tuple[int, int, list[int]]) -> bytes:
            if span[1] == span[0]:
                return b""
            try:
                result = obstore.get(
                    self.store, key, options=cast(Any, {**options, "range": (span[0], span[1])})
                )
                return bytes(result.bytes())
            except FileNotFoundError:
                raise
            except PreconditionError:
                raise StoreIntegrityError(
                    f"{where} was replaced while the store was read ({self.describe(key)})"
                ) from None
            except Exception as err:
                if "range" in str(err).lower() and "not satisfiable" in str(err).lower():
                    return b""
                raise self._errors(err, where) from err

        spans = merged(ranges, gap)
        if not spans:
            return []
        fetched = (
            list(shared_pool("requests", REQUESTS_IN_FLIGHT).map(fetch, spans))
            if len(spans) > 1
            else [fetch(spans[0])]
        )
        out = [b""] * len(ranges)
        for (start, _stop, inside), data in zip(spans, fetched, strict=True):
            for k in inside:
                offset, size = ranges[k]
                out[k] = data[offset - start : offset - start + size]
        return out

    def stat(self, key: str, where: str, *, missing_ok: bool = False) -> Found | None:
        import obstore

        try:
            meta = obstore.head(self.store, key)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise StoreIntegrityError(f"{where} is missing") from None
        except Exception as err:
            raise self._errors(err, where) from err
        return Found(int(meta["size"]), (meta["e_tag"], int(meta["size"])))

    def is_folder(self, key: str) -> bool:
        import obstore

        listed = obstore.list_with_delimiter(self.store, key or None)
        return bool(listed["objects"] or listed["common_prefixes"])

    def listing(self, key: str) -> tuple[dict[str, int], list[str]]:
        import obstore

        prefix = f"{key}/" if key else ""
        found: dict[str, int] = {}
        for batch in obstore.list(self.store, key or None):
            for meta in batch:
                rel = str(meta["path"])[len(prefix) :]
                if not any(is_temporary(part) for part in rel.split("/")):
                    found[rel] = int(meta["size"])
        return found, []

    def names(self, key: str) -> list[str]:
        import obstore

        listed = obstore.list_with_delimiter(self.store, key or None)
        paths = [str(p) for p in listed["common_prefixes"]] + [str(m["path"]) for m in listed["objects"]]
        return sorted(p.rstrip("/").rpartition("/")[2] for p in paths)

    def sha256(self, key: str) -> str:
        import obstore

        digest = hashlib.sha256()
        for block in obstore.get(self.store, key).stream(min_chunk_size=_HASH_BLOCK):
            digest.update(block)
        return digest.hexdigest()

    def prepare(self) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        probe = f"_probe.tmp-{uuid.uuid4().hex}"
        try:
            obstore.put(self.store, probe, b"a", mode="create")
            try:
                obstore.put(self.store, probe, b"b", mode="create")
                refused = False
            except AlreadyExistsError:
                refused = True
        except FileNotFoundError as err:
            raise FilesystemError(
                f"store {self.url}: the bucket does not exist or cannot be reached ({_first_line(err)}); "
                "create it, or check AWS_ENDPOINT_URL / store.options.endpoint"
            ) from None
        except Exception as err:
            raise FilesystemError(f"store {self.url}: cannot write ({_first_line(err)})") from err
        finally:
            with contextlib.suppress(Exception):  # the probe is a temporary: never part of the store
                obstore.delete(self.store, probe)
        if not refused:
            raise FilesystemError(
                f"store {self.url}: the object store accepted a second create-only write of one key "
                "(it ignores `If-None-Match: *`); mopd's crash-safe commit needs conditional writes. Use "
                "a service that supports them (AWS S3, Cloudflare R2, GCS, MinIO), or a filesystem path"
            )

    def create_exclusive(self, key: str, data: bytes, *, what: str = "record") -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        faults.point(f"{what}-written")
        try:
            with faults.io("put", self.describe(key)):
                obstore.put(self.store, key, data, mode="create")
            created = True
        except AlreadyExistsError:
            created = False
        faults.point(f"{what}-linked")
        return created

    def write_same(self, key: str, data: bytes) -> None:
        self.create_exclusive(key, data, what="metadata")

    def workspace(self, key: str) -> Path:
        self.spool.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"mopd-{key.replace('/', '-')}.tmp-", dir=self.spool))

    def publish(self, workspace: Path, key: str, *, what: str, record: str) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        files = sorted(p for p in workspace.rglob("*") if p.is_file())
        faults.point(f"{what}-fsynced")
        try:
            if self.exists(record):  # done by another job: nothing of this one's is uploaded
                return False
            for file in files:
                name = f"{key}/{file.relative_to(workspace).as_posix()}"
                try:
                    with faults.io("put", self.describe(name)), file.open("rb") as data:
                        obstore.put(self.store, name, data, mode="create")
                    continue
                except AlreadyExistsError:
                    pass
                # Another writer's object: its own copy of this task (a rerun, a duplicated job) or one a
                # stopped job left without a part record. The same bytes serve; other bytes are replaced
                # only while no part record says the task is done, and only the version found.
                meta = obstore.head(self.store, name)
                if meta["size"] == file.stat().st_size and self.sha256(name) == sha256_file(file):
                    continue
                if self.exists(record):
                    return False
                try:
                    with faults.io("put", self.describe(name)), file.open("rb") as data:
                        obstore.put(self.store, name, data, mode={"e_tag": meta["e_tag"]})
                except PreconditionError:
                    raise StoreIntegrityError(
                        f"{self.describe(name)} is being written by another job at the same time as this "
                        "one; if no other job writes this task, rerun"
                    ) from None
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        faults.point(f"{what}-renamed")
        return True


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def open_location(where: str | Path | Location, options: Mapping[str, str] | None = None) -> Location:
    """The location a store path or URL names (`base.fsio.store_location` spells both); `options` are
    the object-storage client's settings (`store.options`), ignored for a folder."""
    if isinstance(where, Location):
        return where
    url = object_url(str(where))
    return Folder(where) if url is None else Bucket(url, options)


def require_folder(location: Location, what: str) -> Path:
    """The store's local folder, for work that needs one.

    Raises:
        ConfigError: the store is in a bucket.
    """
    folder = location.local_folder()
    if folder is None:
        raise ConfigError(f"{what} needs a store on a filesystem; {location.url} is in object storage")
    return folder
