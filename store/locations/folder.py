"""A store in a folder of a local or shared POSIX filesystem (`location.Location`).

The commit protocol of DESIGN §4 on a filesystem (`base/fsio.py`): a task is written in a temporary
sibling of its folder, fsynced and renamed onto its name (a rename onto an existing folder fails), and
records are created with `os.link`, which fails when the name exists. Nothing in a store is read through
a symbolic link.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from mopd.base.errors import StoreIntegrityError
from mopd.base.fsio import (
    LINK_REFUSED,
    create_exclusive,
    is_temporary,
    probe_filesystem,
    publish_dir,
    sha256_file,
    unique_temp_name,
    write_replace,
)
from mopd.store.locations.location import Found, Location


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

    def machine_cache(self, name: str) -> Path:
        return self.root / name
