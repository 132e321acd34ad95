"""Acceptance: bad input gives one clear message and exit 1, and leaves nothing that looks complete."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from mopd.cli.main import cli
from tests.precompute.conftest import write_config
from tests.precompute.teachers import (
    make_tokenizer,
    mixed_records,
    other_vocabulary_teacher,
    save_teacher,
    write_jsonl,
)


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


def test_teacher_parallelism_the_backend_cannot_run(tmp_path: Path, teachers: dict[str, Path]) -> None:
    """hf runs a teacher whole on one device; vLLM has its own sequence split."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "math", "text": "a"}])
    if os.environ["MOPD_TEST_BACKEND"] == "hf":
        config = write_config(tmp_path, teachers, data=data, precompute={"parallel": {"tp": 2}})
        assert_refused(config, "precompute.parallel tp=2 × pp=1 needs the vllm or megatron backend")
    else:
        layout = {"tp": 2, "sequence_parallel": True}
        config = write_config(tmp_path, teachers, data=data, precompute={"parallel": layout})
        assert_refused(config, "precompute.parallel.sequence_parallel is the megatron backend's")


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
    missing = tmp_path / "no-such-teacher"
    assert_refused(config, f"names a path that does not exist — teachers.chat: {missing} (")


def other_vocabulary_config(tmp_path: Path, teachers: dict[str, Path]) -> Path:
    other = other_vocabulary_teacher(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(3))  # agents math, code, chat
    return write_config(tmp_path, {**teachers, "chat": other}, data=data)


def test_teacher_with_other_vocabulary(tmp_path: Path, teachers: dict[str, Path]) -> None:
    """A teacher of another tokenizer is stored with its own rows by either backend
    (tests/precompute/test_cross_tokenizer.py checks what they hold)."""
    code, stderr = precompute(other_vocabulary_config(tmp_path, teachers))
    assert code == 0, stderr
    manifest = json.loads((tmp_path / "store.zarr" / "manifest.json").read_text())
    assert manifest["required_features"] == ["cross-tokenizer"]


def test_the_megatron_backend_refuses_a_teacher_of_another_tokenizer(
    tmp_path: Path, teachers: dict[str, Path]
) -> None:
    config = other_vocabulary_config(tmp_path, teachers)
    result = CliRunner().invoke(cli, ["precompute", str(config), "--backend", "megatron"])
    assert result.exit_code == 1, result.stderr
    assert "the megatron backend computes teachers of the store's tokenizer only" in " ".join(
        result.stderr.split()
    )
    assert not (tmp_path / "store.zarr" / "manifest.json").exists()


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


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 70.5, 7]}],
            "row 1: input_ids[1] = 70.5 is not a token id",
        ),
        ([{"input_ids": [5, -2, 7]}], "row 0: input_ids[1] = -2 is not a token id"),
        (
            [{"input_ids": [5, 6, 7]}, {"input_ids": [400, 6]}],
            "row 1: input_ids[0] = 400 is not a token id of the tokenizer (whole numbers from 0 to 399)",
        ),
        ([{"input_ids": [5, 6], "loss_mask": [0, -1]}], "row 0: loss_mask holds -1; it takes 0 and 1"),
        (
            [{"input_ids": [5, 6], "loss_mask": [0, 1]}, {"input_ids": [5, 6, 7], "loss_mask": [1]}],
            "row 1: loss_mask has 1 entries for 3 input_ids",
        ),
    ],
)
def test_given_ids_and_masks_are_checked(
    tmp_path: Path, teachers: dict[str, Path], rows: list[dict], message: str
) -> None:
    """Rows given as ids are the teachers' tokens exactly: nothing is cut, wrapped or filled in."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "math", **row} for row in rows])
    assert_refused(write_config(tmp_path, teachers, data=data), message)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_rows_past_a_teachers_context_are_cut_or_dropped(
    tmp_path: Path, teachers: dict[str, Path], overlong: str
) -> None:
    """A teacher built for 12 positions never sees a row longer than 12 tokens, whatever data.max_length
    says: cut to 12 (its last prediction untrained) or left out; the other teacher's rows are held to
    data.max_length only."""
    from mopd.config.mopd_config import load_config
    from mopd.precompute.runner import run_precompute
    from mopd.store import open_store

    shape: dict = {"hidden_size": 64, "head_dim": 32, "max_position_embeddings": 12}
    short = save_teacher(tmp_path / "short", "llama", seed=9, tokenizer=make_tokenizer(), **shape)
    text = "def add_1(x, y): return x + y * 1 " * 3  # well over 12 tokens
    rows = [{"agent": agent, "text": text} for agent in ("math", "code") * 3]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = write_config(tmp_path, {"math": teachers["math"], "code": short}, data=data)
    config.write_text(config.read_text().replace("max_length: 96", f"max_length: 96\n  overlong: {overlong}"))
    result = run_precompute(load_config(config), show_progress=False, log=lambda *_: None)
    store = open_store(tmp_path / "store.zarr")
    code = next(t.index for t in store.teachers if "code" in t.aliases)
    by_teacher: dict[int, list[int]] = {}
    for r in range(store.num_rows):
        by_teacher.setdefault(int(store.row(r).teacher_index), []).append(r)
    long_rows = [int(store.lengths[r]) for r in by_teacher[1 - code]]
    assert len(long_rows) == 3 and min(long_rows) > 12  # data.max_length 96 holds them whole
    if overlong == "truncate":
        assert [int(store.lengths[r]) for r in by_teacher[code]] == [12, 12, 12]
        assert all(int(store.row(r).loss_mask[-1]) == 0 for r in by_teacher[code])
        assert result.num_truncated == 3
    else:
        assert code not in by_teacher and result.num_dropped == 3


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"text": "a b"}, {"text": None}], "row 1: text is None, not text; every row of a text dataset"),
        (
            [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}],
            "row 1: completion is None, not text; every row of a prompt+completion dataset",
        ),
        (
            [{"prompt": "1+1=", "completion": "2"}, {"text": "plain"}],
            "row 1: prompt is None, not text; every row of a prompt+completion dataset needs it",
        ),
        ([{"text": "a"}, {"text": 7}], "row 1: text is 7, not text"),
    ],
)
def test_every_row_holds_its_formats_columns(
    tmp_path: Path, teachers: dict[str, Path], rows: list[dict], message: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"agent": "math", **row} for row in rows])
    assert_refused(write_config(tmp_path, teachers, data=data), message)


def test_a_teacher_folder_without_weights_names_its_key(tmp_path: Path, teachers: dict[str, Path]) -> None:
    import shutil

    data = write_jsonl(tmp_path / "d.jsonl", mixed_records(4))
    empty = Path(shutil.copytree(teachers["code"], tmp_path / "no-weights"))
    for weights in empty.glob("*.safetensors*"):
        weights.unlink()
    config = write_config(tmp_path, {**teachers, "code": empty}, data=data)
    assert_refused(config, f"teachers.code: {empty} has no model.safetensors or model.safetensors.index.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b'{"agent": "math", "text": "fine"}\n{"agent": "math", "text": "caf\xe9"}\n',
            ": line 2 is not UTF-8",
        ),
        (b"", " holds no rows"),
    ],
    ids=["not-utf8", "empty"],
)
def test_a_data_file_that_is_not_text_or_holds_nothing(
    tmp_path: Path, teachers: dict[str, Path], content: bytes, message: str
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    assert_refused(write_config(tmp_path, teachers, data=data), f"data.path {data}{message}")
