"""A small distillation world shared by the training tests (the `world` fixture builds it once per
session; tests only read it).

Two very different teachers of one hidden size (Llama seed 11 for `math`, Qwen2 seed 12 for `code`), a
fresh Llama student, 64 chat rows whose content depends on their agent, and fp32 stores precomputed by
the real `hf` backend: both teachers over all rows, both teachers over math rows only, the math teacher
alone over math rows, and the math teacher over every row (for self-distillation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mopd.config.mopd_config import MopdConfig, load_config
from mopd.precompute.runner import run_precompute
from tests.precompute.teachers import agent_records, make_tokenizer, save_teacher, write_jsonl


@dataclass(frozen=True)
class World:
    root: Path
    teachers: dict[str, Path]
    student: Path
    data: Path
    math_data: Path
    store: Path  # math + code teachers, all rows
    math_rows_store: Path  # math + code teachers configured, math rows only
    math_teacher_store: Path  # the math teacher alone, math rows only
    self_store: Path  # the math teacher for every row


def write_train_config(
    folder: Path,
    teachers: dict[str, Path],
    *,
    data: Path,
    store: Path,
    student: Path,
    routing: dict[str, Any] | None = None,
    **train: Any,
) -> Path:
    # One tokenizer for every store: transformers picks tokenizer classes by model type, and the Qwen2
    # class tokenises the same vocabulary differently; the stores compared here must hold the same rows.
    """A config for the world; `train` entries override the train section (nested dicts merge)."""
    section: dict[str, Any] = {
        "student": str(student),
        "steps": 5,
        "optim": {"lr": 5.0e-3, "warmup_steps": 2},
        "batch": {"micro_batch_tokens": 512, "global_batch_tokens": 1024},
        "divergence": {"chunk_size": 64},
        "checkpoint": {"every": 100, "keep": 2},
        "output_dir": str(folder / "run"),
    }
    for key, value in train.items():
        section[key] = {**section[key], **value} if isinstance(value, dict) and key in section else value
    raw: dict[str, Any] = {
        "tokenizer": str(student),
        "teachers": {alias: str(path) for alias, path in teachers.items()},
        "data": {"path": str(data), "max_length": 96},
        "store": {"path": str(store), "dtype": "float32"},
        "precompute": {"rows_per_task": 16, "batch_tokens": 1024, "dtype": "float32"},
        "train": section,
    }
    if routing:
        raw["routing"] = routing
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _precompute(folder: Path, teachers: dict[str, Path], data: Path, student: Path, **routing: Any) -> Path:
    config = load_config(
        write_train_config(
            folder, teachers, data=data, store=folder / "store.zarr", student=student, routing=routing or None
        )
    )
    run_precompute(config, log=lambda *_: None)
    return folder / "store.zarr"


def build_world(root: Path) -> World:
    tokenizer = make_tokenizer()
    teachers = {
        "math": save_teacher(root / "math-teacher", "llama", hidden_size=64, seed=11, tokenizer=tokenizer),
        "code": save_teacher(root / "code-teacher", "qwen2", hidden_size=64, seed=12, tokenizer=tokenizer),
    }
    student = save_teacher(root / "student", "llama", hidden_size=64, seed=13, tokenizer=tokenizer)
    records = agent_records(64)
    data = write_jsonl(root / "train.jsonl", records)
    math_data = write_jsonl(root / "math.jsonl", [r for r in records if r["agent"] == "math"])
    math_only = {"math": teachers["math"]}
    return World(
        root=root,
        teachers=teachers,
        student=student,
        data=data,
        math_data=math_data,
        store=_precompute(root / "both", teachers, data, student),
        math_rows_store=_precompute(root / "math-rows", teachers, math_data, student),
        math_teacher_store=_precompute(root / "math-teacher-only", math_only, math_data, student),
        self_store=_precompute(root / "self", math_only, data, student, default_teacher="math"),
    )


def world_config(
    world: World,
    folder: Path,
    *,
    store: Path | None = None,
    teachers: dict[str, Path] | None = None,
    student: Path | None = None,
    routing: dict[str, Any] | None = None,
    **train: Any,
) -> MopdConfig:
    """The world's config (both teachers, all rows) with train overrides, loaded."""
    return load_config(
        write_train_config(
            folder,
            teachers or world.teachers,
            data=world.data,
            store=store or world.store,
            student=student or world.student,
            routing=routing,
            **train,
        )
    )
