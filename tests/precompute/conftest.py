from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.precompute.teachers import make_tokenizer, mixed_records, save_teacher, write_jsonl


@pytest.fixture(scope="session")
def tiny_teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama and Qwen2 teachers (hidden 64, 96, 48) sharing one tokenizer, plus odd ones."""
    root = tmp_path_factory.mktemp("teachers")
    tokenizer = make_tokenizer()
    return {
        "llama": save_teacher(root / "llama-a", "llama", hidden_size=64, seed=1, tokenizer=tokenizer),
        "qwen2": save_teacher(root / "qwen2-b", "qwen2", hidden_size=96, seed=2, tokenizer=tokenizer),
        "llama_small": save_teacher(root / "llama-c", "llama", hidden_size=48, seed=3, tokenizer=tokenizer),
        "gemma2": save_teacher(
            root / "gemma2-d",
            "gemma2",
            hidden_size=64,
            seed=4,
            tokenizer=tokenizer,
            final_logit_softcapping=3.0,
        ),
        "phi": save_teacher(root / "phi-e", "phi", hidden_size=64, seed=5, tokenizer=tokenizer),
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
