"""Acceptance of `mopd rounds` on tiny models: two rounds end to end; SIGKILLs in round 2's precompute and
in its training, then a rerun, give the uninterrupted run's final student bit for bit (CPU, fp32)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import load_config
from mopd.rollout.rounds import Rounds, run_rounds
from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.report.tracking import TENSORBOARD_FOLDER
from tests.mopd_process import run_mopd_process
from tests.precompute.teachers import agent_records, write_jsonl
from tests.rollout.conftest import Models, chat_prompts, rollout_config
from tests.tolerance import U, assert_close
from tests.train.world import World, write_train_config


def rounds_config(world: World, folder: Path, *, count: int, backend: str = "hf", **rounds: Any) -> Path:
    """Both world teachers; 8 chat prompts (2 samples each), 4 held-out ones; 4 steps a round; the
    student trained on `backend`."""
    records = agent_records(12)
    prompts = [{"id": r["id"], "agent": r["agent"], "messages": r["messages"][:1]} for r in records]
    path = write_train_config(
        folder,
        world.teachers,
        data=world.data,
        store=folder / "unused.zarr",
        student=world.student,
        backend=backend,
        checkpoint={"every": 2, "keep": 2},
        divergence={"temperature": 1.5},  # the loss temperature, not the sampling one
    )
    raw = yaml.safe_load(path.read_text())
    raw["rollout"] = {
        "prompts": str(write_jsonl(folder / "prompts.jsonl", prompts[:8])),
        "samples_per_prompt": 2,
        "max_new_tokens": 24,
        "temperature": 0.9,
    }
    raw["rounds"] = {
        "count": count,
        "steps_per_round": 4,
        "workdir": str(folder / "rounds"),
        "heldout_prompts": str(write_jsonl(folder / "heldout.jsonl", prompts[8:])),
        **rounds,
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def final_weights(workdir: Path) -> dict[str, Any]:
    last = complete_checkpoints(workdir / "round-002" / "run" / "checkpoints")[-1]
    assert last.name.endswith("4")
    return load_file(last / "model" / "model.safetensors")


def mopd_rounds(config: Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"MOPD_FAULT": fault} if fault else {})}
    return run_mopd_process(["rounds", str(config)], env=env)


@pytest.mark.slow
def test_two_rounds_and_a_killed_run_that_resumes_bit_identically(world: World, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    lines: list[str] = []
    tracked = load_config(rounds_config(world, whole, count=2), ["train.report_to=[tensorboard]"])
    run_rounds(tracked, log=lines.append)
    records = [json.loads(line) for line in (whole / "rounds" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for record in records:
        assert set(record["heldout_by_teacher"]) == {"math", "code"} and record["heldout_tokens"] > 0
        assert (record["sampling_temperature"], record["loss_temperature"]) == (0.9, 1.5)
    # The ETA: after round 1, its own time for the one round left; after round 2, nothing left.
    took = [re.fullmatch(r"round (\d) took (\S+); eta (\S+)", line) for line in lines]
    assert [m.groups() for m in took if m] == [("1", ANY, ANY), ("2", ANY, "0s")]
    first = next(m for m in took if m)
    assert first.group(2) == first.group(3)
    board = EventAccumulator(str(whole / "rounds" / TENSORBOARD_FOLDER))
    board.Reload()
    shown = board.Scalars("rounds/divergence/math")
    assert [e.step for e in shown] == [0, 1, 2]
    want = [r["heldout_by_teacher"]["math"] for r in records]  # stored as float32: one rounding
    assert_close([e.value for e in shown], want, rtol=U, what="held-out divergence")
    assert (whole / "rounds" / "round-001" / "run" / TENSORBOARD_FOLDER).is_dir()  # each round's run too
    assert (whole / "rounds" / "heldout.png").stat().st_size > 0
    for r in (1, 2):  # round r samples with round r − 1's student and trains from its checkpoint
        rows = whole / "rounds" / f"round-{r:03d}" / "samples.parquet"
        table = pq.read_table(rows).to_pylist()
        assert len(table) == 16 and {row["round"] for row in table} == {r}
        assert {row["sampling_temperature"] for row in table} == {0.9}
        expected = str(world.student) if r == 1 else str(whole / "rounds" / "round-001" / "student")
        assert {row["student"] for row in table} == {expected}

    killed = tmp_path / "killed"
    assert mopd_rounds(rounds_config(world, killed, count=1)).returncode == 0
    config = rounds_config(world, killed, count=2)  # one more round in the same workdir
    assert mopd_rounds(config, "kill@task-renamed:2").returncode == -9  # round 2's precompute
    assert not (killed / "rounds" / "round-002" / "store.zarr" / "manifest.json").exists()
    assert mopd_rounds(config, "kill@checkpoint-written:2").returncode == -9  # round 2's step 4
    assert len(complete_checkpoints(killed / "rounds" / "round-002" / "run" / "checkpoints")) == 1
    done = [
        *(killed / "rounds" / "round-001").rglob("*"),
        killed / "rounds" / "round-002" / "samples.parquet",
    ]
    stamps = {path: path.stat().st_mtime_ns for path in done}
    finished = mopd_rounds(config)
    assert finished.returncode == 0, finished.stderr
    assert "resuming from" in finished.stderr
    assert {path: path.stat().st_mtime_ns for path in done} == stamps  # nothing finished is redone
    reference, resumed = final_weights(whole / "rounds"), final_weights(killed / "rounds")
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert resumed[name].equal(tensor), name


def test_off_policy_rows_are_mixed_in_at_the_fraction(world: World, tmp_path: Path) -> None:
    """off_policy_fraction 0.5: as many rows of data.path (tokenised as precompute does) as samples."""
    from mopd.store.reader import open_store

    config = rounds_config(world, tmp_path, count=1, off_policy_fraction=0.5, heldout_prompts=None)
    run_rounds(load_config(config), log=lambda _line: None)
    folder = tmp_path / "rounds" / "round-001"
    mixed = pq.read_table(folder / "data.parquet").to_pylist()
    assert [row["policy"] for row in mixed] == ["on"] * 16 + ["off"] * 16
    samples = {row["id"]: row for row in pq.read_table(folder / "samples.parquet").to_pylist()}
    for row in mixed[:16]:
        assert row["input_ids"] == samples[row["id"]]["input_ids"]
    assert {row["agent"] for row in mixed[16:]} == {"math", "code"}
    assert open_store(folder / "store.zarr").num_rows == 32
    assert not (tmp_path / "rounds" / "rounds.jsonl").exists()  # no held-out prompts, no evaluation

    raw = yaml.safe_load(config.read_text())
    raw["rollout"]["temperature"] = 0.7  # another config for the same workdir
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        ConfigError, match=r"holds rounds of another config \(sections that differ: rollout\)"
    ):
        run_rounds(load_config(config), log=lambda _line: None)
    raw["rollout"]["temperature"], raw["rounds"]["count"] = 0.9, 2  # only rounds.count may change
    config.write_text(yaml.safe_dump(raw))
    assert Rounds(load_config(config), lambda _line: None).check_settings() is None


@pytest.mark.slow
def test_a_megatron_student_samples_through_its_export(world: World, tmp_path: Path) -> None:
    """train.backend megatron: round 2 samples with round 1's student exported to transformers."""
    run_rounds(load_config(rounds_config(world, tmp_path, count=2, backend="megatron")), log=lambda _l: None)
    workdir = tmp_path / "rounds"
    assert (workdir / "round-001" / "student" / "config.json").exists()
    samples = pq.read_table(workdir / "round-002" / "samples.parquet").to_pylist()
    assert {row["student"] for row in samples} == {str(workdir / "round-001" / "student")}
    records = [json.loads(line) for line in (workdir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]


def test_an_fsdp_student_trains_rounds_from_its_sharded_checkpoints(world: World, tmp_path: Path) -> None:
    """train.backend fsdp (one process: a world of 1): round 2 starts from round 1's sharded checkpoint
    (weights and AdamW state) and samples with its export; held-out evaluation runs on the sharded
    student after every round."""
    run_rounds(load_config(rounds_config(world, tmp_path, count=2, backend="fsdp")), log=lambda _l: None)
    workdir = tmp_path / "rounds"
    for r in (1, 2):
        last = complete_checkpoints(workdir / f"round-{r:03d}" / "run" / "checkpoints")[-1]
        assert (last / "state" / ".metadata").exists()
    assert (workdir / "round-001" / "student" / "model.safetensors").exists()
    samples = pq.read_table(workdir / "round-002" / "samples.parquet").to_pylist()
    assert {row["student"] for row in samples} == {str(workdir / "round-001" / "student")}
    records = [json.loads(line) for line in (workdir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2] and all(r["heldout_tokens"] > 0 for r in records)


@pytest.mark.slow
def test_a_round_that_samples_with_vllm(models: Models, tmp_path: Path) -> None:
    """rollout.backend vllm inside `mopd rounds`: three engines start and stop in one process (round 0's
    held-out samples, round 1's samples, round 1's held-out samples), and the round trains on them."""
    config = rollout_config(tmp_path, models, chat_prompts(6), backend="vllm", samples_per_prompt=2)
    raw = yaml.safe_load(config.read_text())
    raw["store"] = {"path": str(tmp_path / "unused.zarr"), "dtype": "float32"}
    raw["precompute"] = {"rows_per_task": 8, "dtype": "float32"}
    raw["train"].update(
        steps=2,
        batch={"micro_batch_tokens": 512, "global_batch_tokens": 512},
        divergence={"chunk_size": 64},
        output_dir=str(tmp_path / "run"),
    )
    raw["rounds"] = {
        "count": 1,
        "steps_per_round": 2,
        "workdir": str(tmp_path / "rounds"),
        "heldout_prompts": str(write_jsonl(tmp_path / "heldout.jsonl", chat_prompts(8)[6:])),
    }
    config.write_text(yaml.safe_dump(raw))
    run_rounds(load_config(config), log=lambda _line: None)
    workdir = tmp_path / "rounds"
    samples = pq.read_table(workdir / "round-001" / "samples.parquet").to_pylist()
    assert len(samples) == 12 and {row["sampling_backend"] for row in samples} == {"vllm"}
    records = [json.loads(line) for line in (workdir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1] and all(r["heldout_tokens"] > 0 for r in records)
    assert len(complete_checkpoints(workdir / "round-001" / "run" / "checkpoints")) == 1


def test_a_round_with_a_teacher_of_another_tokenizer(world: World, tmp_path: Path) -> None:
    """The code teacher replaced by one of another tokenizer: the student's samples reach it as text,
    the round's store aligns them, the round trains from both teachers, and the held-out evaluation
    reports each teacher's divergence and the other tokenizer's aligned share."""
    from mopd.store.format.manifest import CROSS_TOKENIZER
    from mopd.store.reader import open_store
    from mopd.train.report.metrics import METRICS_FILE, read_metrics
    from tests.precompute.teachers import other_vocabulary_teacher

    config = rounds_config(world, tmp_path, count=1)
    raw = yaml.safe_load(config.read_text())
    raw["teachers"]["code"] = str(other_vocabulary_teacher(tmp_path))
    config.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    run_rounds(load_config(config), log=lines.append)
    folder = tmp_path / "rounds" / "round-001"
    store = open_store(folder / "store.zarr")
    assert store.manifest.required_features == [CROSS_TOKENIZER]
    other = next(t for t in store.teachers if t.tokenizer is not None)
    assert other.aliases == ["code"] and (store.teacher_indices == other.index).any()
    trained = [r for r in read_metrics(folder / "run" / METRICS_FILE) if r.get("split", "train") == "train"]
    assert len(trained) == 4
    assert all(0 < r["aligned_share_by_teacher"][str(other.index)] <= 1 for r in trained)
    records = [json.loads(line) for line in (tmp_path / "rounds" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    for record in records:
        assert set(record["heldout_by_teacher"]) == {"math", "code"}
        assert 0 < record["heldout_aligned_share"]["code"] <= 1
    held_out = [line for line in lines if "held-out divergence" in line]
    assert re.fullmatch(r"round 1: held-out divergence .* code [\d.]+ aligned \d+\.\d%\)", held_out[-1])
