"""`mopd quickstart --small` end to end through the CLI: real SmolLM2 teachers, offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mopd.cli.main import cli
from mopd.cli.quickstart_assets import STUDENT, write_dataset
from mopd.store.reader import open_store
from mopd.train.report.metrics import read_metrics
from mopd.train.report.tracking import TENSORBOARD_FOLDER
from tests.precompute.teachers import assert_same_chat_tokens
from tests.tolerance import assert_same_training


@pytest.mark.slow
def test_small_quickstart_runs_every_stage(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        cli, ["quickstart", "--small", "--workdir", str(tmp_path), "--report-to", "tensorboard"]
    )
    assert out.exit_code == 0, out.output
    for stage in ("1/4 prepare", "2/4 precompute", "3/4 verify-manifest", "4/4 train"):
        assert stage in out.output
    assert "held-out KL per token" in out.output and "as fp32 full-vocabulary logits" in out.output
    assert "chat, math" in out.output and "%" in out.output
    store = open_store(tmp_path / "quickstart-small.zarr")
    assert [t.aliases for t in store.teachers] == [["chat", "math"], ["code"]]  # 3 aliases, 2 teachers
    assert store.num_rows == 18
    records = read_metrics(tmp_path / "quickstart-small-run" / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("split") == "eval"] == [0, 2, 4]
    # Teachers by name wherever a person reads: no `t0=`, `'0':` or `teacher 0` on the console.
    assert not re.findall(r".*(?:\bt\d=|'\d':|teacher \d).*", out.output)
    assert re.search(r"^eval step 4: divergence \S+ \[chat\+math=\S+ code=\S+\]$", out.output, re.M)
    board = tmp_path / "quickstart-small-run" / TENSORBOARD_FOLDER
    assert f"tensorboard --logdir {board}" in out.output
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/divergence/code")] == [0, 2, 4]
    assert (tmp_path / "quickstart-small-run" / "metrics.png").stat().st_size > 10_000
    exported = CliRunner().invoke(
        cli, ["export-hf", str(tmp_path / "quickstart-small-run"), str(tmp_path / "exported")]
    )
    assert exported.exit_code == 0, exported.output
    assert_same_chat_tokens(tmp_path / "exported", tmp_path / "models" / STUDENT)  # chat template kept
    # Again on the fsdp backend (one process: a world of 1): reuses models, data and store, trains
    # afresh, the same steps within `assert_same_training`; its checkpoint holds shards and exports.
    again = CliRunner().invoke(
        cli, ["quickstart", "--small", "--workdir", str(tmp_path), "--backend", "fsdp"]
    )
    assert again.exit_code == 0, again.output
    sharded = read_metrics(tmp_path / "quickstart-small-run" / "metrics.jsonl")
    train = [[r for r in run if r.get("split", "train") == "train"] for run in (sharded, records)]
    assert_same_training(*train, layers=4, width=1536)  # the student: SmolLM2's first 4 blocks, MLP 1536
    checkpoint = tmp_path / "quickstart-small-run" / "checkpoints" / "step_00000004"
    assert (checkpoint / "state" / ".metadata").exists() and not (
        checkpoint / "model" / "model.safetensors"
    ).exists()
    exported = CliRunner().invoke(cli, ["export-hf", str(checkpoint), str(tmp_path / "exported-fsdp")])
    assert exported.exit_code == 0, exported.output
    assert_same_chat_tokens(tmp_path / "exported-fsdp", tmp_path / "models" / STUDENT)


def test_the_dataset_has_three_agents_with_agent_specific_content(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in write_dataset(tmp_path / "d.jsonl", 5).read_text().splitlines()]
    assert [r["agent"] for r in rows[:6]] == ["math", "code", "chat"] * 2
    by_agent = {
        agent: [r["messages"][1]["content"] for r in rows if r["agent"] == agent]
        for agent in ("math", "code", "chat")
    }
    assert all("=" in answer for answer in by_agent["math"])
    assert all(answer.startswith("```python\ndef ") for answer in by_agent["code"])
    assert all(answer.endswith(".") for answer in by_agent["chat"])
    assert write_dataset(tmp_path / "e.jsonl", 5).read_text() == (tmp_path / "d.jsonl").read_text()  # seeded
