"""Maps each top-level folder to `mopd.<folder>` and lists its nested packages for wheels."""

from pathlib import Path

from setuptools import setup

TOP_LEVEL = ("base", "tokens", "store", "config", "mcore", "precompute", "train", "rollout", "cli")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for top in TOP_LEVEL:
        for init in sorted(Path(top).rglob("__init__.py")):
            folder = init.parent
            name = "mopd." + ".".join(folder.parts)
            packages.append(name)
            package_dir[name] = folder.as_posix()
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)
