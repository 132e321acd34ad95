from __future__ import annotations

import os
from pathlib import Path

import pytest

from mopd.base.errors import FilesystemError, ManifestError
from mopd.base.fsio import SafePaths, create_exclusive, probe_filesystem, publish_dir, safe_join


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


@pytest.mark.parametrize("many", [False, True], ids=["safe_join", "SafePaths"])
def test_safe_join_refuses_escapes(tmp_path: Path, many: bool) -> None:
    root = tmp_path / "store"
    (root / "a" / "b").mkdir(parents=True)
    join = SafePaths(root).join if many else lambda relative: safe_join(root, relative)
    assert join("teachers/0") == root / "teachers" / "0"
    for bad in ("../outside", "/etc/passwd", "a/../../b"):
        with pytest.raises(ManifestError, match="must be relative"):
            join(bad)
    os.symlink(root / "a", root / "inside")
    assert join("inside/b") == root / "inside" / "b"  # a link that stays in the store
    os.symlink(tmp_path, root / "a" / "link")
    join("a/b")  # its parents checked once, the link below them is still found
    with pytest.raises(ManifestError, match="leads outside the store"):
        join("a/link/x")
