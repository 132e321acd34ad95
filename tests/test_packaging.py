"""The wheel carries every package folder (nested ones too) under the `mopd` namespace."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path: Path) -> None:
    source = tmp_path / "src"  # build from a copy: setuptools leaves build/ in the folder it builds
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("mopd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"mopd/{p.relative_to(REPO).as_posix()}"
        for top in ("store", "config", "mcore", "precompute", "train", "cli")
        for p in (REPO / top).rglob("*.py")
    }
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("mopd/__init__") for n in names)  # mopd stays a namespace
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mopd = mopd.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
