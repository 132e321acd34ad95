from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.forked  # noqa: F401  (sets the forkserver's preload before any test starts it)
from tests.object_store import S3Server
from tests.store.synthetic import StoreSpec, build_store, make_checkpoint
from tests.train.world import World, build_world

pytest_plugins = ["tests.processes"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files that hold `slow` tests run first: the workers take whole files in this order (pyproject's
    `--dist loadfile`), and the many quick files that come last even out when each worker ends.

    `gpu`-marked tests need a CUDA device: where there is none (CI) they are skipped, the only tests
    that ever are; bench/gpu.sh runs them on a GPU machine."""
    import torch

    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: a file's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def teacher_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Three checkpoints with one vocabulary and different hidden sizes."""
    return {
        "math": make_checkpoint(tmp_path / "ckpt" / "math-teacher", hidden_size=48, seed=1),
        "code": make_checkpoint(tmp_path / "ckpt" / "code-teacher", hidden_size=64, seed=2),
        "chat": make_checkpoint(tmp_path / "ckpt" / "chat-teacher", hidden_size=32, seed=3, tied=True),
    }


@pytest.fixture
def small_spec(tmp_path: Path, teacher_checkpoints: dict[str, Path]) -> StoreSpec:
    """4 aliases over 3 checkpoints, 14 short rows of mixed agents."""
    ckpt = {name: str(path.resolve()) for name, path in teacher_checkpoints.items()}
    agents = [
        "math",
        "code",
        "chat",
        "reasoning",
        "math",
        "code",
        "math",
        "chat",
        "reasoning",
        "code",
        "math",
        "math",
        "chat",
        "code",
    ]
    return StoreSpec(
        root=str(tmp_path / "store.zarr"),
        teachers={
            "math": ckpt["math"],
            "code": ckpt["code"],
            "chat": ckpt["chat"],
            "reasoning": ckpt["math"],
        },
        hidden_sizes={ckpt["math"]: 48, ckpt["code"]: 64, ckpt["chat"]: 32},
        agents=agents,
        lengths=[(7 * i) % 23 + 1 for i in range(len(agents))],
    )


@pytest.fixture
def small_store(small_spec: StoreSpec) -> StoreSpec:
    build_store(small_spec)
    return small_spec


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Two tiny teachers, a student and four precomputed stores (see tests/train/world.py)."""
    return build_world(tmp_path_factory.mktemp("distill"))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A local S3 server (moto) for the session."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket's `s3://` URL, with the `AWS_*` variables (this process's and its children's)
    pointing at the local server."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server.bucket()
