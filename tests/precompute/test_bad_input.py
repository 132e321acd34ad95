"""Acceptance: bad input gives one clear message and exit 1, and leaves nothing that looks complete."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from mopd.cli.main import cli
from tests.precompute.conftest import write_config
from tests.precompute.teachers import make_tokenizer, mixed_records, save_teacher, write_jsonl


@pytest.fixture(autouse=True)
def _every_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs each test once per backend (`precompute` below passes it as --backend)."""
    monkeypatch.setenv("MOPD_TEST_BACKEND", backend)


def precompute(config: Path, *args: str) -> tuple[int, str]:
    backend = os.environ["MOPD_TEST_BACKEND"]
    result = CliRunner().invoke(cli, ["precompute", str(config), "--backend", backend, *args])
    return result.exit_code, result.stderr


def assert_refused(config: Path, message: str) -> None:
    code, stderr = precompute(config)
    assert code == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr
    assert message in " ".join(stderr.split()), stderr
    assert not (config.parent / "store.zarr" / "manifest.json").exists()


@pytest.fixture
def teachers(tiny_teachers: dict[str, Path]) -> dict[str, Path]:
    return {"math": tiny_teachers["llama"], "code": tiny_teachers["qwen2"]}


def test_unknown_agent_without_default(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"agent": "math", "text": "a"}, {"agent": "poetry", "text": "b"}]
    )
    assert_refused(write_config(tmp_path, teachers, data=data), "row 1: agent 'poetry' has no teacher")


def test_teacher_parallelism_needs_the_megatron_backend(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "math", "text": "a"}])
    config = write_config(tmp_path, teachers, data=data, precompute={"parallel": {"tp": 2}})
    assert_refused(config, "precompute.parallel tp=2 × pp=1 needs the megatron backend")


def test_missing_routing_column(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    assert_refused(write_config(tmp_path, teachers, data=data), "dataset has no routing column 'agent'")


def test_empty_dataset(tmp_path: Path, teachers: dict[str, Path]) -> None:
    import datasets

    datasets.Dataset.from_dict({"agent": [], "text": []}).to_parquet(tmp_path / "empty.parquet")
    assert_refused(write_config(tmp_path, teachers, data=tmp_path / "empty.parquet"), "holds no rows")


def test_unsupported_columns(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "math", "question": "a", "answer": "b"}])
    assert_refused(
        write_config(tmp_path, teachers, data=data),
        "dataset columns ['agent', 'answer', 'question'] hold no supported input",
    )


def test_nonexistent_checkpoint(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(4))
    config = write_config(tmp_path, {**teachers, "chat": tmp_path / "no-such-teacher"}, data=data)
    assert_refused(config, "teachers.chat: checkpoint")


def test_teacher_with_other_vocabulary(tmp_path: Path, teachers: dict[str, Path]) -> None:
    other = save_teacher(
        tmp_path / "other-vocab", "llama", hidden_size=32, seed=7, tokenizer=make_tokenizer(vocab_size=380)
    )
    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(4))
    assert_refused(
        write_config(tmp_path, {**teachers, "chat": other}, data=data), "has a different tokenizer vocabulary"
    )


def test_store_of_another_dataset_or_teacher_set(
    tmp_path: Path, teachers: dict[str, Path], tiny_teachers: dict[str, Path]
) -> None:
    records = [{**r, "agent": "math" if i % 2 else "code"} for i, r in enumerate(mixed_records(4))]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    config = write_config(tmp_path, teachers, data=data)
    assert precompute(config)[0] == 0
    manifest = (tmp_path / "store.zarr" / "manifest.json").read_bytes()
    write_jsonl(data, records[:3])
    code, stderr = precompute(config)
    assert code == 1 and "already holds a store of a different run (dataset" in stderr
    config = write_config(tmp_path, {**teachers, "math": tiny_teachers["llama_small"]}, data=data)
    code, stderr = precompute(config)
    assert code == 1 and "already holds a store of a different run" in stderr and "teachers" in stderr
    assert (tmp_path / "store.zarr" / "manifest.json").read_bytes() == manifest  # untouched


def test_task_index_usage_errors(tmp_path: Path, teachers: dict[str, Path]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(4))
    config = write_config(tmp_path, teachers, data=data)
    assert precompute(config, "--num-tasks", "3")[0] == 2
    assert precompute(config, "--num-tasks", "3", "--task-index", "3")[0] == 2
