"""A real small filesystem for the full-disk tests: a tmpfs of a given size mounted on a folder.

Mounting needs privileges (root, as on the development and CI machines); where the mount is refused, the
caller falls back to the fault-injection hook (`MOPD_FAULT=enospc@...`) and says so.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _mount(folder: Path, size: int, *, remount: bool = False) -> bool:
    options = f"{'remount,' if remount else ''}size={size}"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


@contextmanager
def small_filesystem(folder: Path, size: int) -> Iterator[SmallFilesystem | None]:
    """`folder` (created) as a tmpfs of `size` bytes while the block runs; None where it cannot be
    mounted here."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mounted = _mount(folder, size)
    except OSError:  # no mount command
        mounted = False
    try:
        yield SmallFilesystem(folder) if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


class SmallFilesystem:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def grow(self, size: int) -> None:
        """Gives the filesystem `size` bytes, its files kept (room again after a full disk)."""
        assert _mount(self.folder, size, remount=True), "tmpfs remount failed"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def full_disk_error(code: int, stderr: str) -> str:
    """The one `error:` line of a command that found the disk full (asserted: exit 1, no traceback,
    the file named with the space left)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: write failed: No space left on device: "), errors
    assert errors[0].endswith("MiB free on its filesystem)"), errors
    return errors[0]
