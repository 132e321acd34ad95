"""Training from an int8-rotated store: the first step's loss is the exact store's within what the codes'
logit error allows, and a run never resumes on a store of another encoding (nor verifies against one)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from mopd.base.errors import CheckpointError
from mopd.config.mopd_config import load_config
from mopd.precompute.runner import run_precompute
from mopd.store import open_store
from mopd.store.format.loading import read_manifest
from mopd.store.format.manifest import INT8_ROTATED
from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.checkpoint.verify import check_checkpoint
from mopd.train.trainer import run_training
from tests.fault_trials import train_records
from tests.train.world import World, world_config, write_train_config


@pytest.fixture(scope="module")
def coded_store(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world's main store (both teachers, all rows), int8-rotated."""
    folder = tmp_path_factory.mktemp("int8")
    config = write_train_config(
        folder, world.teachers, data=world.data, store=folder / "store.zarr", student=world.student
    )
    raw = yaml.safe_load(config.read_text())
    raw["store"]["encoding"] = INT8_ROTATED
    config.write_text(yaml.safe_dump(raw))
    run_precompute(load_config(config), show_progress=False, log=lambda *_: None)
    return folder / "store.zarr"


def largest_logit_error(world: World, coded: Path) -> float:
    """max over every token and vocabulary entry of |z − ẑ|: the teacher logits' error."""
    exact, decoded = open_store(world.store), open_store(coded)
    rows = np.arange(exact.num_rows)
    heads = {t.index: exact.lm_head(t.index) for t in exact.teachers}
    return max(
        float(((x - y) @ heads[exact.row(int(r)).teacher_index].T).abs().max())
        for r, x, y in zip(rows, exact.hiddens(rows), decoded.hiddens(rows), strict=True)
    )


def test_the_first_step_is_the_exact_stores_within_the_logit_error(
    world: World, coded_store: Path, tmp_path: Path
) -> None:
    quiet = {"log": lambda _line: None}
    exact = train_records(run_training(world_config(world, tmp_path / "exact"), **quiet).output)
    coded = train_records(
        run_training(world_config(world, tmp_path / "coded", store=coded_store), **quiet).output
    )
    assert len(exact) == len(coded) == 5
    # Same student, teachers off by Δ in each logit: each token's reverse KL E_s[log s − log p] moves by
    # at most max|log p − log p̂| ≤ 2 max|Δ|, and so does their weighted mean, the loss.
    assert abs(coded[0]["loss"] - exact[0]["loss"]) <= 2 * largest_logit_error(world, coded_store)
    assert coded[0]["loss"] != exact[0]["loss"]  # the codes are not the exact states
    assert all(np.isfinite(r["loss"]) for r in coded)


def test_a_run_does_not_resume_or_verify_on_a_store_of_another_encoding(
    world: World, coded_store: Path, tmp_path: Path
) -> None:
    settings = {"steps": 4, "checkpoint": {"every": 2, "keep": 2}}
    run_training(world_config(world, tmp_path, **settings), max_steps=2, log=lambda _line: None)
    checkpoint = complete_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    changed = re.escape("store.encoding: 'exact' in the checkpoint, 'int8-rotated' now")
    with pytest.raises(CheckpointError, match=changed):
        run_training(world_config(world, tmp_path, store=coded_store, **settings), log=lambda _line: None)
    problems = check_checkpoint(checkpoint, read_manifest(coded_store))
    assert problems == [
        f"{checkpoint} was trained on a store of encoding 'exact', this store's is 'int8-rotated': a resume "
        "on it is refused"
    ]
    assert check_checkpoint(checkpoint, read_manifest(world.store)) == []
