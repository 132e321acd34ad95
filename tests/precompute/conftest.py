from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from tests.precompute.teachers import (
    make_tokenizer,
    mixed_records,
    other_vocabulary_teacher,
    save_teacher,
    write_jsonl,
)

BACKENDS = ["hf", "vllm"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each precompute backend that runs on this machine: the behaviour tests hold for every one."""
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama and Qwen2 teachers (hidden 64, 96, 48) sharing one tokenizer, plus odd ones; heads of
    size 32, the least that vLLM runs, so that every backend can run each of them."""
    root = tmp_path_factory.mktemp("teachers")
    tokenizer = make_tokenizer()

    def save(name: str, arch: str, hidden_size: int, seed: int, **extra: Any) -> Path:
        return save_teacher(
            root / name, arch, hidden_size=hidden_size, seed=seed, tokenizer=tokenizer, head_dim=32, **extra
        )

    return {
        "llama": save("llama-a", "llama", 64, 1),
        "qwen2": save("qwen2-b", "qwen2", 96, 2),
        "llama_small": save("llama-c", "llama", 48, 3),
        "gemma2": save("gemma2-d", "gemma2", 64, 4, final_logit_softcapping=3.0),
        "phi": save("phi-e", "phi", 64, 5),
    }


def write_config(
    folder: Path, teachers: dict[str, Any], *, data: Path, store: str = "store.zarr", **sections: Any
) -> Path:
    raw = {
        "teachers": {alias: str(path) for alias, path in teachers.items()},
        "data": {"path": str(data), "max_length": 96},
        "store": {"path": store, "dtype": "float32"},
        "precompute": {"rows_per_task": 3, "batch_tokens": 256, "dtype": "float32"},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def routed_config(root: Path, teachers: dict[str, Path], rows: int = 12) -> Path:
    """`write_config` over `rows` chat rows routed to the aliases in turn, 4 rows a task."""
    agents = list(teachers)
    records = [{**r, "agent": agents[i % len(agents)]} for i, r in enumerate(mixed_records(rows))]
    data = write_jsonl(root / "train.jsonl", records)
    store = str(root / "store.zarr")
    return write_config(root, teachers, data=data, store=store, precompute={"rows_per_task": 4})


def four_aliases(tiny_teachers: dict[str, Path]) -> dict[str, Path]:
    """4 aliases over 3 checkpoints (Llama 64, Qwen2 96, Llama 48)."""
    return {
        "math": tiny_teachers["llama"],
        "code": tiny_teachers["qwen2"],
        "chat": tiny_teachers["llama_small"],
        "reasoning": tiny_teachers["llama"],
    }


@pytest.fixture
def mixed_config(tmp_path: Path, tiny_teachers: dict[str, Path]) -> Path:
    """4 aliases over 3 checkpoints, 16 chat rows of 4 agents."""
    data = write_jsonl(tmp_path / "train.jsonl", mixed_records(16))
    return write_config(tmp_path, four_aliases(tiny_teachers), data=data)


@pytest.fixture(scope="session")
def cross_store(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> dict[str, Any]:
    """Chat rows for a teacher of the store's tokenizer (`math`) and one of another byte-level BPE (`chat`:
    380 tokens trained on the corpus without its arithmetic, so that it merges otherwise), in turn."""
    root = tmp_path_factory.mktemp("cross")
    other = other_vocabulary_teacher(root)
    teachers = {"math": tiny_teachers["llama"], "chat": other}
    config = routed_config(root, teachers, rows=10)
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"] = str(tiny_teachers["llama"])
    config.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    result = run_precompute(load_config(config), show_progress=False, log=lines.append)
    assert result.manifest is not None
    store = open_store(raw["store"]["path"])
    return {
        "store": store,
        "other": other,
        "same": tiny_teachers["llama"],
        "student": tiny_teachers["llama_small"],  # of the store's tokenizer, and no teacher
        "config": config,
        "log": lines,
    }


def train_config(cross_store: dict[str, Any], folder: Path, student: Path, **train: Any) -> Path:
    """The cross store's config with a train section: `student`, 3 steps over every row."""
    raw = yaml.safe_load(cross_store["config"].read_text())
    raw["train"] = {
        "student": str(student),
        "steps": 3,
        "optim": {"lr": 5.0e-3, "warmup_steps": 1},
        "batch": {"micro_batch_tokens": 256, "global_batch_tokens": 512},
        "divergence": {"chunk_size": 32},
        "output_dir": str(folder / "run"),
        **train,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
