from __future__ import annotations

import os
from pathlib import Path

import pytest

from mopd.base.errors import FilesystemError, ManifestError, StoreIntegrityError
from mopd.base.fsio import create_exclusive, probe_filesystem, publish_dir, safe_relative
from mopd.store.locations.folder import Folder


def test_create_exclusive_never_overwrites(tmp_path: Path) -> None:
    assert create_exclusive(tmp_path / "r.json", b"first")
    assert not create_exclusive(tmp_path / "r.json", b"second")
    assert (tmp_path / "r.json").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_publish_dir_refuses_a_taken_name(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    assert not publish_dir(tmp_path / "b", tmp_path / "a")
    assert (tmp_path / "a" / "f").read_text() == "a"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "f").write_text("c")
    assert publish_dir(tmp_path / "c", tmp_path / "d")
    assert (tmp_path / "d" / "f").read_text() == "c"


def test_probe_passes_here_and_leaves_nothing(tmp_path: Path) -> None:
    probe_filesystem(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_probe_names_filesystem_when_rename_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def overwriting_rename(src: Path, dst: Path) -> None:  # a filesystem that replaces non-empty folders
        os.replace(Path(src) / "f", Path(dst) / "f")
        Path(src).rmdir()

    monkeypatch.setattr(os, "rename", overwriting_rename)
    with pytest.raises(FilesystemError, match=r"\(\w+\) does not refuse rename onto a non-empty folder"):
        probe_filesystem(tmp_path)


def test_record_paths_stay_inside_the_store_and_no_link_is_followed(tmp_path: Path) -> None:
    """A path a record holds is relative and has no `..`; a store is read without following a link,
    whether it stays inside the store or leads out of it."""
    assert safe_relative("teachers/0") == "teachers/0"
    for bad in ("../outside", "/etc/passwd", "a/../../b", "~/x"):
        with pytest.raises(ManifestError, match="must be relative"):
            safe_relative(bad)
    root = tmp_path / "store"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"data")
    os.symlink(root / "a", root / "inside")
    os.symlink(tmp_path, root / "a" / "out")
    folder = Folder(root)
    assert folder.read("a/b/f", "f", limit=10) == b"data"
    for linked in ("inside/b/f", "a/out/store/a/b/f"):
        with pytest.raises(StoreIntegrityError, match="symbolic link"):
            folder.read(linked, linked, limit=10)
    os.symlink(root / "a" / "b" / "f", root / "a" / "b" / "g")
    with pytest.raises(StoreIntegrityError, match="symbolic link"):
        folder.stat("a/b/g", "g")
