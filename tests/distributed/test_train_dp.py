"""Data parallelism under the real launcher: `torchrun --nproc-per-node 2 -m mopd.cli train` on gloo."""

from __future__ import annotations

from pathlib import Path

from mopd.train.checkpoint.state import complete_checkpoints
from mopd.train.report.metrics import METRICS_FILE, read_metrics
from mopd.train.trainer import run_training
from tests.distributed.harness import run_torchrun
from tests.tolerance import assert_same_training, perturbed
from tests.train.world import World, world_config


def test_two_ranks_under_torchrun_match_one_rank(world: World, tmp_path: Path) -> None:
    """Same global batch, 5 steps: DP=2 equals DP=1 within `assert_same_training`'s bounds
    (microbatches of 256 tokens, so ranks run several, and not always as many as each other)."""
    options = dict(steps=5, batch={"micro_batch_tokens": 256, "global_batch_tokens": 1024})
    config_path = tmp_path / "config.yaml"
    world_config(world, tmp_path, **options)  # the DP=2 run's config
    # Perturbed: the reference packs other microbatches and chunks (same arithmetic, other order).
    reference = dict(
        steps=5,
        batch={"micro_batch_tokens": 128 if perturbed() else 256, "global_batch_tokens": 1024},
        divergence={"chunk_size": 48 if perturbed() else 64},
    )
    single = run_training(
        world_config(world, tmp_path / "reference", **reference), output=tmp_path / "dp1", log=lambda _l: None
    )

    log = run_torchrun(["train", str(config_path), "--output", str(tmp_path / "dp2")], nproc=2)
    assert log.count("step 5/5") == 1  # only rank 0 prints, the run's closing line included
    assert (
        log.count(f"trained steps 1..5; checkpoint {tmp_path / 'dp2' / 'checkpoints' / 'step_00000005'}") == 1
    )
    assert log.count("on cpu: backend hf (data parallel over 2), 2 processes, float32 throughout") == 1

    ones = [r for r in single.records if r.get("split", "train") == "train"]
    twos = read_metrics(tmp_path / "dp2" / METRICS_FILE)
    assert [r["step"] for r in twos] == [1, 2, 3, 4, 5]
    assert [r["trained_tokens"] for r in twos] == [r["trained_tokens"] for r in ones]
    assert_same_training(twos, ones, layers=2, width=128)  # the world's 2-block student, 128 wide
    assert [p.name for p in complete_checkpoints(tmp_path / "dp2" / "checkpoints")] == ["step_00000005"]

    # The 2-rank run goes on in one process (the rank count is not part of a run): step 6 trains.
    longer = world_config(world, tmp_path / "longer", **{**options, "steps": 6})
    resumed = run_training(longer, output=tmp_path / "dp2", log=lambda _l: None)
    assert (resumed.first_step, resumed.last_step) == (6, 6)
    assert [r["step"] for r in read_metrics(tmp_path / "dp2" / METRICS_FILE)] == [1, 2, 3, 4, 5, 6]
