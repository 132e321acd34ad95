"""Durable filesystem primitives of the commit protocol (DESIGN §4).

Durable before visible: every file and folder is fsynced before a rename publishes it, and the parent
is fsynced after. Publication never overwrites: folders are renamed onto names that must not exist (a
rename onto a non-empty folder fails on POSIX filesystems) and records are created with `os.link`,
which fails when the name exists. `probe_filesystem` checks that both really fail where the store lives.
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from mopd.base import faults
from mopd.base.errors import ConfigError, FilesystemError, ManifestError

_HASH_BLOCK = 1 << 22
# How a reader refuses a symbolic link inside a store ("<path>: " or "<path> is " before it).
LINK_REFUSED = (
    "a symbolic link, which a store never holds and mopd never follows; put the file itself there, or "
    "rebuild the store"
)


# Object-storage URL schemes a store may live under (through obstore).
OBJECT_SCHEMES = ("s3", "gs")


def _scheme(text: str) -> str | None:
    scheme, separator, _ = text.partition("://")
    return scheme.lower() if separator and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) else None


def object_url(text: str) -> str | None:
    """`text` as an object-storage URL (`s3://bucket/prefix`, no trailing slash); None for a path or a
    file:// URL."""
    scheme = _scheme(text)
    return text.rstrip("/") if scheme in OBJECT_SCHEMES else None


def store_location(location: str | Path, *, what: str) -> str:
    """A store location as mopd keeps it: an object-storage URL as written, a `file://` URL as its path.

    Raises:
        ConfigError: another URL scheme, or an object URL without a bucket; `what` names the setting.
    """
    text = str(location)
    scheme = _scheme(text)
    if scheme is None:
        return text
    if scheme == "file":
        return unquote(urlparse(text).path)
    if scheme not in OBJECT_SCHEMES:
        raise ConfigError(
            f"{what} {text}: a store is a path, a file:// URL or an object-storage URL "
            f"({', '.join(f'{s}://bucket/prefix' for s in OBJECT_SCHEMES)}); mopd does not know {scheme}://"
        )
    bucket = text.partition("://")[2].partition("/")[0]
    if len(bucket) < 3:
        raise ConfigError(f"{what} {text}: name the bucket, as in {scheme}://bucket/prefix")
    return text.rstrip("/")


def fsync_path(path: Path) -> None:
    with faults.io("fsync", path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with faults.io("write", path), path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsyncs every file, then every folder bottom-up, then the root itself; each file is first given
    the mode the umask gives (`follow_umask`)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            follow_umask(Path(folder) / name)
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


# The mode of a private temporary file (`mkstemp`'s), which safetensors' writer leaves its files with.
_PRIVATE = 0o600


def follow_umask(path: Path) -> None:
    """Gives a file left private by the library that wrote it (0600) the mode any other new file gets
    under the process's umask (0644 under 022), so that a teammate or a serving job can read what mopd
    wrote. Any other mode is left as it is."""
    if (os.stat(path).st_mode & 0o777) == _PRIVATE:
        os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc); elsewhere set and reset."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE).group(1), 8)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def unique_temp_name(final: Path) -> Path:
    """A sibling of `final` that no other writer can pick: `<name>.tmp-<pid>@<host>-<uuid>`, which names
    the process that owns it, so that a later job can tell a stopped job's leftover from a live one's."""
    return final.with_name(f"{final.name}.tmp-{os.getpid()}@{platform.node()}-{uuid.uuid4().hex}")


def is_temporary(name: str) -> bool:
    return ".tmp-" in name


def temporary_owner(name: str) -> tuple[int, str] | None:
    """(pid, host) of the process that made a temporary; None where its name does not say (an earlier
    mopd's)."""
    owner, _, _uuid = name.partition(".tmp-")[2].rpartition("-")
    pid, at, host = owner.partition("@")
    return (int(pid), host) if at and pid.isdigit() else None


def owner_stopped(name: str) -> bool:
    """The temporary's owner was a process of this host that no longer runs (so it is garbage)."""
    owner = temporary_owner(name)
    if owner is None or owner[1] != platform.node() or owner[0] == os.getpid():
        return False
    try:
        os.kill(owner[0], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def create_exclusive(path: Path, data: bytes, *, what: str = "record") -> bool:
    """Creates `path` with `data`, durably, only if it does not exist.

    `what` names the kill points `<what>-written` and `<what>-linked` (see `faults`).

    Returns:
        True if this call created it; False if the name already existed (its content untouched).
    """
    temp = unique_temp_name(path)
    try:
        _write_durably(temp, data)
        faults.point(f"{what}-written")
        try:
            with faults.io("link", path):
                os.link(temp, path)
            created = True
        except FileExistsError:
            created = False
    finally:
        temp.unlink(missing_ok=True)
    fsync_path(path.parent)
    faults.point(f"{what}-linked")
    return created


def write_replace(path: Path, data: bytes) -> None:
    """Writes `path` atomically (temp + fsync + rename); for files whose every version is identical."""
    temp = unique_temp_name(path)
    try:
        _write_durably(temp, data)
        with faults.io("rename", path):
            os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_path(path.parent)


def write_replace_with(path: Path, write: Callable[[Path], object]) -> None:
    """As `write_replace`, for a file too large to hold in memory: `write(temp)` streams it into a
    temporary sibling, which is fsynced and renamed into place."""
    temp = unique_temp_name(path)
    try:
        write(temp)
        follow_umask(temp)
        fsync_path(temp)
        with faults.io("rename", path):
            os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_path(path.parent)


def publish_dir(temp: Path, final: Path, *, what: str = "folder") -> bool:
    """Makes a fully written temporary folder visible under its final name.

    `what` names the kill points `<what>-fsynced` and `<what>-renamed` (see `faults`).

    Returns:
        True if published; False if `final` already exists with content (another writer won).
    """
    fsync_tree(temp)
    faults.point(f"{what}-fsynced")
    try:
        with faults.io("rename", final):
            os.rename(temp, final)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    fsync_path(final.parent)
    faults.point(f"{what}-renamed")
    return True


def file_digests(root: Path) -> dict[str, tuple[int, str]]:
    """Relative path → (size, sha256) for every file below `root`, sorted by path."""
    out: dict[str, tuple[int, str]] = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            out[path.relative_to(root).as_posix()] = (path.stat().st_size, sha256_file(path))
    return dict(sorted(out.items()))


def files_digest(root: Path, names: list[str] | None = None) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of a file, or of the files of a folder (`names`: only those)."""
    if root.is_file():
        return [(root.name, root.stat().st_size, sha256_file(root))]
    paths = [root / n for n in names] if names is not None else sorted(p for p in root.rglob("*"))
    return [(p.relative_to(root).as_posix(), p.stat().st_size, sha256_file(p)) for p in paths if p.is_file()]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def safe_relative(relative: str) -> str:
    """A path read from a record, as a key inside the store: relative and without `..`.

    Raises:
        ManifestError: an absolute path, or one with a `..` component.
    """
    parts = relative.split("/")
    if relative.startswith(("/", "~")) or ".." in parts or "\\" in relative:
        raise ManifestError(f"path {relative!r} in a store record must be relative and stay inside the store")
    return relative


def _filesystem_type(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            _dev, mount, kind, *_ = line.split()
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, kind
    except OSError:
        pass
    return fstype


def probe_filesystem(root: Path) -> None:
    """Checks that exclusive create and rename-onto-non-empty-folder fail here, as the protocol needs.

    Raises:
        FilesystemError: naming the filesystem type when either guarantee is missing.
    """
    probe = root / f"_probe.tmp-{uuid.uuid4().hex}"
    probe.mkdir(parents=True)
    try:
        record = probe / "record"
        first = create_exclusive(record, b"a")
        second = create_exclusive(record, b"b")
        kept = record.read_bytes() == b"a"
        (probe / "d1").mkdir()
        (probe / "d1" / "f").write_bytes(b"1")
        (probe / "d2").mkdir()
        (probe / "d2" / "f").write_bytes(b"2")
        try:
            os.rename(probe / "d2", probe / "d1")
            rename_refused = False
        except OSError:
            rename_refused = True
        if not (first and not second and kept and rename_refused):
            fstype = _filesystem_type(root)
            raise FilesystemError(
                f"the filesystem under {root} ({fstype}) does not refuse "
                f"{'exclusive re-creation' if second or not kept else 'rename onto a non-empty folder'}; "
                "mopd's crash-safe commit needs both. Put the store on a POSIX filesystem "
                "(local disk, NFSv4, Lustre, GPFS)."
            )
    finally:
        for folder, _dirs, files in os.walk(probe, topdown=False):
            for name in files:
                (Path(folder) / name).unlink()
            Path(folder).rmdir()
