"""A store under a prefix of an object-storage bucket (`location.Location`), through obstore.

A bucket has no rename and no hard link; it has conditional writes. A task's folder is written in a
local workspace, then each file is uploaded to its key with a create-only write (`If-None-Match: *`); a
key that exists already is another writer's copy of the task (kept where its bytes are this one's) or a
stopped job's leftover, replaced only while the task has no part record and only at the version found
(`If-Match`). The part record is created last the same way, so a second writer gets 412 and takes the
task as done by another job. Reads are byte ranges, merged where close (`location.merged`) and run
concurrently, each conditional on the version a reader first saw.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from mopd.base import faults
from mopd.base.errors import ConfigError, FilesystemError, StoreIntegrityError
from mopd.base.fsio import is_temporary, sha256_file
from mopd.store.locations.location import (
    REQUESTS_IN_FLIGHT,
    Found,
    Location,
    merged,
    shared_pool,
    spool_folder,
)

_HASH_BLOCK = 8 << 20


class Bucket(Location):
    """A store under a prefix of an object-storage bucket (`s3://bucket/prefix`, `gs://…`), through
    obstore. Endpoint, region and credentials come from the environment (`AWS_ENDPOINT_URL`,
    `AWS_REGION`, `AWS_ACCESS_KEY_ID`…, or `GOOGLE_…` for gs://) and from `options` (obstore's settings,
    e.g. `endpoint`, `region`, `allow_http`)."""

    remote = True

    def __init__(self, url: str, options: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.options = dict(options or {})
        self._store: Any = None
        self.spool = spool_folder()

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

        spans = merged(ranges)
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

    def machine_cache(self, name: str) -> Path:
        return self.spool / f"mopd-{name}" / hashlib.sha256(self.url.encode()).hexdigest()[:16]

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
