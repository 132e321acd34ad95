"""Stages of one process each own their process groups: a megatron precompute at tp=2 followed by
training at tp=1 (as `mopd rounds` runs them) trains at tp=1; a run that fails while it is set up under
torchrun leaves no process group behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from mopd.train.backends.megatron import DIST_CHECKPOINT
from tests.distributed.harness import run_distributed
from tests.precompute.teachers import agent_records, make_tokenizer, save_teacher, write_jsonl
from tests.train.world import write_train_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One teacher (two key/value heads, so that tp=2 splits it) under two aliases, a student, 16 rows;
    precompute runs the megatron backend at tp=2, training the megatron backend at tp=1."""
    root = tmp_path_factory.mktemp("stage-layouts")
    tokenizer = make_tokenizer()
    teacher = save_teacher(
        root / "teacher", "llama", hidden_size=64, seed=41, tokenizer=tokenizer, num_key_value_heads=2
    )
    student = save_teacher(root / "student", "llama", hidden_size=64, seed=42, tokenizer=tokenizer)
    path = write_train_config(
        root,
        {"math": teacher, "code": teacher},
        data=write_jsonl(root / "train.jsonl", agent_records(16)),
        store=root / "store.zarr",
        student=student,
        backend="megatron",
        device="cpu",
        steps=2,
    )
    raw = yaml.safe_load(path.read_text())
    raw["precompute"] |= {"backend": "megatron", "device": "cpu", "parallel": {"tp": 2, "pp": 1}}
    path.write_text(yaml.safe_dump(raw))
    return path


def _precompute_then_train(rank: int, world_size: int, config_path: str) -> dict:
    from megatron.core import parallel_state

    from mopd.config.mopd_config import load_config
    from mopd.precompute.runner import run_precompute
    from mopd.train.trainer import run_training

    config = load_config(Path(config_path))
    run_precompute(config, show_progress=False, log=lambda *_: None)
    after_precompute = parallel_state.model_parallel_is_initialized()
    result = run_training(config, log=lambda _line: None)
    return {
        "after_precompute": after_precompute,
        "after_training": parallel_state.model_parallel_is_initialized(),
        "world_kept": dist.is_initialized(),  # the harness's group: not the stages' to destroy
        "checkpoint": str(result.checkpoint),
    }


def test_precompute_at_tp2_then_training_at_tp1_in_one_process(config: Path) -> None:
    results = run_distributed(_precompute_then_train, world_size=2, args=(str(config),), timeout=300)
    assert [r["after_precompute"] for r in results] == [False, False]
    assert [r["after_training"] for r in results] == [False, False]
    assert [r["world_kept"] for r in results] == [True, True]
    checkpoint = Path(results[0]["checkpoint"])
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["layout"] == {"backend": "megatron", "format": DIST_CHECKPOINT}
    # The embedding was saved as one slice holding the whole vocabulary, not as two tensor-parallel
    # halves: the training ran at tp=1.
    entries = dcp.FileSystemReader(str(checkpoint / "state")).read_metadata().state_dict_metadata
    slices = entries["embedding.word_embeddings.weight"].chunks
    assert len(slices) == 1 and slices[0].sizes[0] >= len(make_tokenizer())


PROBE = """
import sys
import torch.distributed as dist
from mopd.base.errors import MopdError
from mopd.config.mopd_config import load_config
from mopd.train.trainer import Trainer

try:
    Trainer(load_config(sys.argv[1]), store_path=sys.argv[2], log=lambda _line: None)
except MopdError as err:
    print(f"refused: {type(err).__name__}; process group left: {dist.is_initialized()}", flush=True)
"""


def test_a_failed_set_up_under_torchrun_leaves_no_process_group(config: Path, tmp_path: Path) -> None:
    """Under torchrun the session makes the world's process group before it opens the store: a store
    that is not there (refused with every other missing path of the config: a ConfigError) ends the
    set-up, and the group with it."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*launch, str(probe), str(config), str(tmp_path / "no-store.zarr")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", **os.environ},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Counted, not split into lines: the two ranks share one stdout, and their lines may interleave.
    refusals = done.stdout.count("refused: ")
    assert refusals == done.stdout.count("refused: ConfigError; process group left: False") == 2, (
        done.stdout + done.stderr[-2000:]
    )
