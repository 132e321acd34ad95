"""Rows of several teachers end to end (issue 49): routing to sets through precompute into the store, and
training on it with each `train.ensemble.method`, resumed bit for bit; `verify-manifest` and `inspect`
on such a store. Real tiny transformers teachers (two hidden sizes), a real store on disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mopd.cli.main import cli
from mopd.config.mopd_config import MopdConfig, load_config
from mopd.precompute.runner import run_precompute
from mopd.store.format.layout import set_members
from mopd.store.format.manifest import TEACHER_SETS
from mopd.store.reader import open_store
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import run_training
from tests.precompute.teachers import agent_records, make_tokenizer, save_teacher, write_jsonl
from tests.train.world import World, write_train_config

# Each agent's teachers: one, two or three of them (`chat` has a hidden size of its own), an alias
# listed twice, and `math2`, a second alias of the math checkpoint (one teacher, scored once a row).
ROUTING = {
    "teachers_field": "teachers",
    "teacher_by_agent": {
        "math": "math",
        "code": ["code"],
        "both": ["math", "code", "math"],
        "all": ["chat", "math2", "code", "math"],
    },
}
AGENT_SETS = {"math": {"math"}, "code": {"code"}, "both": {"math", "code"}, "all": {"chat", "math", "code"}}


@dataclass(frozen=True)
class Sets:
    root: Path
    teachers: dict[str, Path]
    student: Path
    data: Path
    store: Path
    chosen: list[set[str]]  # each row's teachers, by alias


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Sets:
    root = tmp_path_factory.mktemp("sets")
    tokenizer = make_tokenizer()
    math = save_teacher(root / "math", "llama", hidden_size=64, seed=11, tokenizer=tokenizer)
    teachers = {
        "math": math,
        "math2": math,
        "code": save_teacher(root / "code", "qwen2", hidden_size=64, seed=12, tokenizer=tokenizer),
        "chat": save_teacher(root / "chat", "llama", hidden_size=48, seed=14, tokenizer=tokenizer),
    }
    student = save_teacher(root / "student", "llama", hidden_size=64, seed=13, tokenizer=tokenizer)
    records = agent_records(24)
    for i, record in enumerate(records):
        record["agent"] = ("math", "code", "both", "math", "code", "all")[i % 6]
    records[7]["teachers"] = ["chat", "code"]  # a row's own list (routing.teachers_field) over its agent's
    data = write_jsonl(root / "train.jsonl", records)
    config = config_for(root / "precompute", teachers, data, root / "store.zarr", student)
    run_precompute(config, log=lambda *_: None)
    chosen = [set(r.get("teachers") or AGENT_SETS[r["agent"]]) for r in records]
    return Sets(root, teachers, student, data, root / "store.zarr", chosen)


def config_for(
    folder: Path, teachers: dict[str, Path], data: Path, store: Path, student: Path, **train: Any
) -> MopdConfig:
    options: dict[str, Any] = {"steps": 4, "checkpoint": {"every": 2, "keep": 3}}
    options |= train
    path = write_train_config(
        folder, teachers, data=data, store=store, student=student, routing=ROUTING, **options
    )
    return load_config(path)


def test_rows_routed_to_one_two_and_three_teachers_store_each_teacher_once(sets: Sets) -> None:
    store = open_store(sets.store)
    assert TEACHER_SETS in store.manifest.required_features
    index = {alias: t.index for t in store.manifest.teachers for alias in t.aliases}
    assert len(store.manifest.teachers) == 3  # math and math2 are one checkpoint: one teacher
    assert store.teacher_sets is not None
    for row, chosen in enumerate(sets.chosen):
        want = tuple(sorted(index[a] for a in chosen))
        assert set_members(int(store.teacher_sets[row])) == want, row
        assert store.teacher_indices[row] == want[0]
    for teacher in store.manifest.teachers:
        stored = np.sort(
            np.concatenate(
                [
                    store._array(s.path, "row_ids").read()
                    for s in store.manifest.shards
                    if s.teacher == teacher.index
                ]
            )
        )
        wanted = [r for r, chosen in enumerate(sets.chosen) if teacher.aliases[0] in chosen]
        assert stored.tolist() == wanted, teacher.aliases  # each row once, in its teachers' shards only
    shown = " ".join(CliRunner().invoke(cli, ["inspect", str(sets.store)]).stdout.split())  # unfolded
    sets_line = "code 7; math+math2 8; chat & code 1; code & math+math2 4; chat & code & math+math2 4"
    assert f"rows by teachers: {sets_line}" in shown


def test_one_teacher_lists_store_and_train_as_aliases_do(world: World, tmp_path: Path) -> None:
    """Routing each agent to a list of one alias stores the same rows and states as routing it to the
    alias (no teacher sets), so the run is bit for bit the same."""
    listed = {"teacher_by_agent": {"math": ["math"], "code": ["code", "code"]}}
    path = write_train_config(
        tmp_path,
        world.teachers,
        data=world.data,
        store=tmp_path / "store.zarr",
        student=world.student,
        routing=listed,
        steps=2,
    )
    config = load_config(path)
    run_precompute(config, log=lambda *_: None)
    mine, theirs = open_store(tmp_path / "store.zarr"), open_store(world.store)
    assert mine.teacher_sets is None and TEACHER_SETS not in mine.manifest.required_features
    assert mine.manifest.dataset == theirs.manifest.dataset
    assert [s.hash for s in mine.manifest.shards] == [s.hash for s in theirs.manifest.shards]
    assert mine.manifest.rows.hash == theirs.manifest.rows.hash
    ours = run_training(config, log=lambda _: None).records
    base = load_config(
        write_train_config(
            tmp_path / "base",
            world.teachers,
            data=world.data,
            store=world.store,
            student=world.student,
            steps=2,
        )
    )
    assert [r["loss"] for r in ours] == [r["loss"] for r in run_training(base, log=lambda _: None).records]


@pytest.mark.parametrize("method", ["mixture", "sum", "min_ce", "confidence"])
def test_each_method_trains_reports_and_resumes_exactly(sets: Sets, tmp_path: Path, method: str) -> None:
    """Four steps at once equal two steps, a resume and two more, bit for bit; the records key the
    divergence by target (a set's for mixtures) and give choosing methods' selection shares."""
    weights = {"teacher_weights": {"code": 0.5}, "ensemble": {"method": method}}
    whole = config_for(tmp_path / "whole", sets.teachers, sets.data, sets.store, sets.student, **weights)
    parts = config_for(tmp_path / "parts", sets.teachers, sets.data, sets.store, sets.student, **weights)
    expected = [r["loss"] for r in run_training(whole, log=lambda _: None).records]
    run_training(parts, log=lambda _: None, max_steps=2)
    resumed = run_training(parts, log=lambda _: None)
    assert resumed.first_step == 3
    records = read_metrics(tmp_path / "parts" / "run" / METRICS_FILE)
    assert [r["loss"] for r in records] == expected
    keys = set().union(*(r["divergence_by_teacher"] for r in records))
    store = open_store(sets.store)
    index = {alias: str(t.index) for t in store.manifest.teachers for alias in t.aliases}
    together = ",".join(sorted([index["math"], index["code"]]))
    assert (together in keys) == (method in ("mixture", "confidence"))
    chooses = method in ("min_ce", "confidence")
    assert all(("selection_share_by_teacher" in r) == chooses for r in records)
    if chooses:
        shares = records[-1]["selection_share_by_teacher"]
        assert set(shares) == {index["chat"], index["code"], index["math"]}
        assert all(0.0 <= v <= 1.0 for v in shares.values())


def test_verify_manifest_refuses_a_changed_teacher_set(sets: Sets, tmp_path: Path) -> None:
    original = sets.root / "precompute" / "config.yaml"
    clean = CliRunner().invoke(cli, ["verify-manifest", str(sets.store), "--config", str(original), "--full"])
    assert clean.exit_code == 0, clean.output
    config = yaml.safe_load(original.read_text())
    config["routing"]["teacher_by_agent"]["both"] = ["math", "chat"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["verify-manifest", str(sets.store), "--config", str(path)])
    assert result.exit_code == 1
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    store = open_store(sets.store)
    index = {alias: t.index for t in store.manifest.teachers for alias in t.aliases}
    was = ", ".join(str(i) for i in sorted({index["math"], index["code"]}))
    now = ", ".join(str(i) for i in sorted({index["math"], index["chat"]}))
    assert lines == [
        f"routing.teacher_by_agent.both: teachers {was} (aliases 'math', 'code') in the store, "
        f"teachers {now} (aliases 'math', 'chat') in the config"
    ]
