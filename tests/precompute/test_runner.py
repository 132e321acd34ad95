"""Task running: batches, one load per teacher, SLURM arrays, the run summary, non-finite teachers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mopd.base.batching import pack_batches, select_tasks
from mopd.cli.main import cli
from mopd.config.mopd_config import load_config
from mopd.precompute import runner
from tests.precompute.conftest import write_config
from tests.precompute.teachers import make_tokenizer, mixed_records, save_teacher, write_jsonl


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60), budget=st.integers(1, 2000))
def test_pack_batches_covers_rows_within_budget(lengths: list[int], budget: int) -> None:
    row_ids = np.arange(100, 100 + len(lengths))
    lengths_arr = np.array(lengths)
    batches = pack_batches(row_ids, lengths_arr, batch_tokens=budget)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == row_ids.tolist()  # every row exactly once
    by_row = dict(zip(row_ids.tolist(), lengths, strict=True))
    ordered = [by_row[r] for r in flat.tolist()]
    assert ordered == sorted(ordered, reverse=True)  # longest first
    for batch in batches:
        padded = max(by_row[r] for r in batch.tolist()) * len(batch)
        assert padded <= budget or len(batch) == 1


def test_select_tasks_partitions() -> None:
    ids = [f"t{i}" for i in range(11)]
    shares = [select_tasks(ids, num_tasks=3, task_index=i) for i in range(3)]
    assert sorted(t for share in shares for t in share) == sorted(ids)
    assert all(set(a).isdisjoint(b) for a in shares for b in shares if a is not b)


def test_slurm_array_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    assert runner.slurm_task_split() is None
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    assert runner.slurm_task_split() == (4, 2)


def test_each_teacher_loaded_once_and_summary_printed(
    mixed_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    real = runner.load_teacher

    def counting(config, backend, checkpoint, **kwargs):  # type: ignore[no-untyped-def]
        loads.append(checkpoint)
        return real(config, backend, checkpoint, **kwargs)

    monkeypatch.setattr(runner, "load_teacher", counting)
    result = CliRunner().invoke(cli, ["precompute", str(mixed_config)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    tasks = load_config(mixed_config).precompute.rows_per_task
    assert tasks < 8  # several tasks per teacher (rows + 3 heads + 7 shards = 11 tasks), yet:
    assert sorted(loads) == sorted(set(loads)) and len(loads) == 3
    assert "computed 11 tasks, skipped 0 already done" in result.stderr
    assert "manifest written" in result.stderr
    assert "math, reasoning" in result.stderr  # the per-teacher summary table
    # Ingest shows its progress, then says where the rows went; a later job reads them back.
    assert "tokenising rows: 100%" in result.stderr and "ingest: tokenised" in result.stderr
    again = CliRunner().invoke(cli, ["precompute", str(mixed_config)])
    assert "computed 0 tasks, skipped 11 already done" in again.stderr
    assert "ingest: reading the tokenised rows" in again.stderr and "tokenising rows" not in again.stderr


def test_non_finite_teacher_is_refused_naming_row(tmp_path: Path, backend: str) -> None:
    tokenizer = make_tokenizer()
    teacher = save_teacher(
        tmp_path / "nan-teacher", "llama", hidden_size=32, seed=3, tokenizer=tokenizer, head_dim=32
    )
    records = mixed_records(6)
    poisoned = tokenizer("§")["input_ids"][-1]  # a byte no other row contains
    records[4]["messages"][1]["content"] += " §"
    assert all("§" not in str(r) for i, r in enumerate(records) if i != 4)
    weights = load_file(teacher / "model.safetensors")
    weights["model.embed_tokens.weight"][poisoned] = torch.nan
    save_file(weights, teacher / "model.safetensors")
    data = write_jsonl(tmp_path / "d.jsonl", [{**r, "agent": "t"} for r in records])
    config = write_config(tmp_path, {"t": teacher}, data=data, precompute={"backend": backend})
    result = CliRunner().invoke(cli, ["precompute", str(config)])
    assert result.exit_code == 1
    assert "teacher 0" in result.stderr and "non-finite hidden states for row 4" in result.stderr
    assert not (tmp_path / "store.zarr" / "manifest.json").exists()
