"""A teacher of another tokenizer in a row of several teachers (issue 49 with issue 47): precompute stores
its tokenisation and alignment beside the other teachers' states, training projects it first and then
combines, and a row of two such teachers is refused. Exactness by construction: a teacher whose ids are
permuted (`permuted_teacher`) has, projected, the distribution of the teacher it was made from, so a
mixture of the two is that teacher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from mopd.base.errors import ConfigError
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.store.format.manifest import CROSS_TOKENIZER, TEACHER_SETS
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import run_training
from tests.precompute.teachers import mixed_records, other_vocabulary_teacher, write_jsonl
from tests.precompute.test_cross_tokenizer_training import permuted_teacher
from tests.tolerance import assert_close, trajectory_rtol


def config(folder: Path, teachers: dict[str, Path], tokenizer: Path, routing: dict, **train: Any) -> Path:
    """8 chat rows of the agent `chat`, precompute and 3 training steps, as the permuted-teacher test's."""
    folder.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(folder / "chat.jsonl", [{**r, "agent": "chat"} for r in mixed_records(8)])
    raw = {
        "tokenizer": str(tokenizer),
        "teachers": {alias: str(path) for alias, path in teachers.items()},
        "routing": routing,
        "data": {"path": str(data), "max_length": 96},
        "store": {"path": str(folder / "store.zarr"), "dtype": "float32"},
        "precompute": {"rows_per_task": 4, "batch_tokens": 256, "dtype": "float32"},
        "train": {
            "steps": 3,
            "optim": {"lr": 5.0e-3, "warmup_steps": 1},
            "batch": {"micro_batch_tokens": 256, "global_batch_tokens": 512},
            "divergence": {"chunk_size": 32},
            "output_dir": str(folder / "run"),
            **train,
        },
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))
    return folder / "config.yaml"


def trained(path: Path, log: Any = lambda _: None) -> list[dict[str, Any]]:
    """Precompute (its lines to `log`), train, and the run's training records."""
    cfg = load_config(path)
    run_precompute(cfg, show_progress=False, log=log)
    run_training(cfg, log=lambda _: None)
    out = Path(cfg.train.output_dir) / METRICS_FILE
    return [r for r in read_metrics(out) if r.get("split", "train") == "train"]


# Rows of `math` (the store's tokenizer), of `chat` (another) and of both, by each row's own list.
LISTS = [["math"], ["chat"], ["math", "chat"]]
ROWS = [{**r, "agent": "chat", "teachers": LISTS[i % 3]} for i, r in enumerate(mixed_records(12))]
SETS_ROUTING = {"teacher_by_agent": {"chat": "math"}, "teachers_field": "teachers"}


def sets_config(
    folder: Path, teachers: dict[str, Path], tokenizer: Path, rows: list[dict[str, Any]], **train: Any
) -> Path:
    """`config` over `rows` routed by their own lists (`SETS_ROUTING`)."""
    path = config(folder, teachers, tokenizer, SETS_ROUTING, **train)
    write_jsonl(Path(yaml.safe_load(path.read_text())["data"]["path"]), rows)
    return path


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory, tiny_teachers: dict[str, Path]) -> dict[str, Any]:
    """The run of every row routed to the llama teacher alone, and the permuted copy of it."""
    root = tmp_path_factory.mktemp("cross-sets")
    teacher = tiny_teachers["llama"]
    permuted = permuted_teacher(teacher, root / "permuted-teacher", seed=5)
    student = {"student": str(tiny_teachers["llama_small"])}
    path = config(root / "alone", {"chat": teacher}, teacher, {}, **student)
    return {"root": root, "teacher": teacher, "permuted": permuted, "records": trained(path), **student}


@pytest.mark.parametrize("method", ["mixture", "min_ce"])
def test_a_teacher_and_its_permuted_copy_in_one_set_train_that_teachers_run(
    alone: dict[str, Any], tiny_teachers: dict[str, Path], method: str
) -> None:
    """Every row routed to {the teacher, its permuted copy}: the copy goes through its own tokenisation,
    the alignment and the projection (every position aligned), and the ensemble of the two (`mixture`:
    their mean; `min_ce`: either, as both give each next token one probability) trains each step's loss
    and divergence within two fp32 trajectories' rounding (3 steps of a 2-block network) of the
    teacher's run alone."""
    folder = alone["root"] / method
    teachers = {"chat": alone["teacher"], "copy": alone["permuted"]}
    routing = {"teacher_by_agent": {"chat": ["chat", "copy"]}}
    path = config(
        folder, teachers, alone["teacher"], routing, student=alone["student"], ensemble={"method": method}
    )
    records = trained(path)
    store = open_store(folder / "store.zarr")
    assert store.manifest.required_features == sorted([CROSS_TOKENIZER, TEACHER_SETS])
    other = next(t.index for t in store.teachers if t.tokenizer is not None)
    for i in range(store.num_rows):
        assert store.teachers_of(i) == (0, 1) and store.other_tokenizer(i) == other
        mask = store.row(i).loss_mask.numpy().astype(bool)
        assert (store.aligned(i)[mask] >= 0).all()
    rtol = trajectory_rtol(3, 2, 128)
    for got, want in zip(records, alone["records"], strict=True):
        assert got["aligned_share_by_teacher"] == {str(other): 1.0}
        assert_close(got["loss"], want["loss"], rtol=rtol, what=f"step {want['step']} loss")
        assert_close(got["divergence"], want["divergence"], rtol=rtol, what=f"step {want['step']} divergence")


def test_rows_of_one_or_two_teachers_with_one_of_another_tokenizer(
    alone: dict[str, Any], tiny_teachers: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rows routed, by their own lists, to `math` (the store's tokenizer), to `chat` (another, merging
    otherwise: some positions unaligned) and to both: the store holds chat's alignment for each of its
    rows; training reports the mixture of both, chat's aligned share over all its rows and its span term,
    and two steps, a resume and two more equal four at once bit for bit. A row of two teachers of other
    tokenizers is refused at precompute in one line naming it."""
    root = alone["root"] / "both"
    # In a folder whose path sorts after the others': chat is not its rows' lowest teacher index.
    other = other_vocabulary_teacher(tmp_path_factory.mktemp("zz-other"))
    teachers = {"math": tiny_teachers["llama"], "chat": other, "copy": alone["permuted"]}
    train = {"student": alone["student"], "steps": 4}
    paths = {
        name: sets_config(root / name, teachers, tiny_teachers["llama"], ROWS, **train)
        for name in ("whole", "parts")
    }
    lines: list[str] = []
    whole = trained(paths["whole"], log=lines.append)
    # Precompute's shares name chat alone, over all its rows (mixed rows count for it, not for math).
    assert [line.split(":")[0] for line in lines if "another tokenizer" in line] == [
        "teacher chat (another tokenizer)"
    ]
    store = open_store(root / "whole" / "store.zarr")
    index = {alias: t.index for t in store.teachers for alias in t.aliases}
    assert index["chat"] > index["math"]
    assert [store.other_tokenizer(i) for i in range(store.num_rows)] == [
        index["chat"] if "chat" in LISTS[i % 3] else None for i in range(12)
    ]
    mixed = ",".join(str(t) for t in sorted([index["math"], index["chat"]]))
    assert {str(index["math"]), str(index["chat"]), mixed} <= set().union(
        *(r["divergence_by_teacher"] for r in whole)
    )
    shares = [r["aligned_share_by_teacher"][str(index["chat"])] for r in whole]
    assert all(0.3 < share < 1.0 for share in shares), shares
    assert all(np.isfinite(r["span"]) and r["span"] > 0 for r in whole)
    cfg = load_config(paths["parts"])
    run_precompute(cfg, show_progress=False, log=lambda _: None)
    run_training(cfg, max_steps=2, log=lambda _: None)
    assert run_training(cfg, log=lambda _: None).first_step == 3
    parts = read_metrics(Path(cfg.train.output_dir) / METRICS_FILE)
    assert [r["loss"] for r in parts] == [r["loss"] for r in whole]
    two_others = [{**ROWS[0], "teachers": ["chat", "copy"]}]
    refused = sets_config(root / "refused", teachers, tiny_teachers["llama"], two_others, **train)
    with pytest.raises(ConfigError, match=r"^row 0 has 2 teachers of tokenizers other than the store's"):
        run_precompute(load_config(refused), show_progress=False, log=lambda _: None)


@pytest.mark.distributed
def test_two_data_parallel_ranks_with_unequal_ensemble_work_match_one(
    alone: dict[str, Any], tiny_teachers: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`torchrun --nproc-per-node 2` on a store of rows of `math`, of `chat` (another tokenizer) and of
    both, microbatches of 128 tokens: the ranks' steps differ in microbatches, in rows of several teachers
    and in rows of the other tokenizer, yet every rank runs the same collectives, and the run equals one
    process's: the same trained tokens, divergence keys and aligned shares (counts, exactly), losses and
    gradient norms within `assert_same_training` (the student: a 2-block llama, 48 wide)."""
    from mopd.train.data.order import epoch_steps, rank_microbatches
    from tests.distributed.harness import run_torchrun
    from tests.tolerance import assert_same_training

    root = tmp_path_factory.mktemp("cross-sets-dp")
    other = other_vocabulary_teacher(tmp_path_factory.mktemp("zz-other-dp"))
    teachers = {"math": tiny_teachers["llama"], "chat": other}
    batch = {"micro_batch_tokens": 128, "global_batch_tokens": 512}
    train = {"student": alone["student"], "batch": batch}
    paths = {
        name: sets_config(root / name, teachers, tiny_teachers["llama"], ROWS, **train)
        for name in ("one", "two")
    }
    one = trained(paths["one"])
    store = open_store(root / "one" / "store.zarr")
    work = []  # per step and rank: (microbatches, rows of several teachers, rows with chat's alignment)
    for step in epoch_steps(store.lengths, seed=0, epoch=0, global_batch_tokens=512)[:3]:
        for rank in (0, 1):
            micro = rank_microbatches(step, store.lengths, dp_rank=rank, dp_size=2, micro_batch_tokens=128)
            flat = [int(i) for m in micro for i in m]
            several = sum(len(store.teachers_of(i)) > 1 for i in flat)
            work.append((len(micro), several, sum(store.other_tokenizer(i) is not None for i in flat)))
    assert any(work[2 * s] != work[2 * s + 1] for s in range(3)), work
    cfg = load_config(paths["two"])
    run_precompute(cfg, show_progress=False, log=lambda _: None)
    run_torchrun(["train", str(paths["two"])], nproc=2)
    two = [
        r
        for r in read_metrics(Path(cfg.train.output_dir) / METRICS_FILE)
        if r.get("split", "train") == "train"
    ]
    for mine, theirs in zip(two, one, strict=True):
        assert mine["trained_tokens"] == theirs["trained_tokens"]
        assert mine["aligned_share_by_teacher"] == theirs["aligned_share_by_teacher"]
        assert set(mine["divergence_by_teacher"]) == set(theirs["divergence_by_teacher"])
    assert any("," in key for key in one[0]["divergence_by_teacher"])  # a mixture among the targets
    assert_same_training(two, one, layers=2, width=128)
