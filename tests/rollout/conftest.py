"""A tiny student and another model of the same vocabulary (heads of 32, the least vLLM runs), prompts in
both formats, and the config that samples them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.precompute.teachers import agent_records, make_tokenizer, save_teacher, write_jsonl


@dataclass(frozen=True)
class Models:
    root: Path
    student: Path
    other: Path  # another model of the student's vocabulary; also the teachers


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("rollout-models")
    tokenizer = make_tokenizer()
    student = save_teacher(
        root / "student", "llama", hidden_size=64, seed=13, tokenizer=tokenizer, head_dim=32
    )
    other = save_teacher(root / "other", "qwen2", hidden_size=64, seed=14, tokenizer=tokenizer, head_dim=32)
    return Models(root, student, other)


def chat_prompts(count: int) -> list[dict[str, Any]]:
    """`messages` prompts (one user turn) of two agents, with ids."""
    return [{"id": r["id"], "agent": r["agent"], "messages": r["messages"][:1]} for r in agent_records(count)]


def text_prompts(count: int) -> list[dict[str, Any]]:
    return [
        {"id": r["id"], "agent": r["agent"], "prompt": r["messages"][0]["content"]}
        for r in agent_records(count)
    ]


def rollout_config(folder: Path, models: Models, prompts: list[dict[str, Any]], **rollout: Any) -> Path:
    """A config whose teachers are the other model; `rollout` entries override the rollout section."""
    folder.mkdir(parents=True, exist_ok=True)
    section = {
        "prompts": str(write_jsonl(folder / "prompts.jsonl", prompts)),
        "samples_per_prompt": 3,
        "max_new_tokens": 16,
        "prompts_per_part": 4,
        "output": str(folder / "samples.parquet"),
        **rollout,
    }
    raw = {
        "teachers": {"math": str(models.other), "code": str(models.other)},
        "data": {"path": str(folder / "unused.jsonl"), "max_length": 64},
        "train": {"student": str(models.student)},
        "rollout": section,
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
