"""The training session: evaluation builds no optimiser, and a run that fails while it is being set up
leaves no process group and no model-parallel state behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mopd.base.errors import ConfigError
from mopd.train.evaluation import evaluate_student
from mopd.train.session import open_session
from mopd.train.trainer import Trainer
from tests.train.world import World, world_config


def test_evaluation_builds_no_optimizer(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`evaluate_student` holds the student's parameters and nothing of an optimiser: no optimiser is
    constructed, so no parameter state past the model's exists; its record is the session's
    evaluation of every row."""
    config = world_config(world, tmp_path)
    with open_session(config, log=lambda _line: None) as session:
        want = session.evaluate(np.arange(session.store.num_rows), step=0)
    built: list[Any] = []
    original = torch.optim.Optimizer.__init__

    def counting(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counting)
    got = evaluate_student(config, store_path=world.store, log=lambda _line: None)
    assert built == []
    assert got == want and got["divergence"] > 0
    Trainer(config, log=lambda _line: None).close()
    assert built == ["AdamW"]  # the counter sees what a training run builds


def model_parallel_is_initialized() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


@pytest.mark.parametrize(
    ("where", "change", "message"),
    [
        ("session", {"vocab_size": 100_000}, "train.vocab_size: 100000 is more than"),
        ("trainer", {"eval": {"rows": 1000}}, "train.eval.rows"),
    ],
)
def test_a_failed_set_up_leaves_no_process_group(
    world: World, tmp_path: Path, where: str, change: dict, message: str
) -> None:
    """A megatron student in one process makes a one-rank world and megatron-core's model-parallel
    state; a failure after both, in the session (`where` session) or in the trainer built on it, closes
    both."""
    config = world_config(world, tmp_path, backend="megatron", device="cpu", **change)
    with pytest.raises(ConfigError, match=message):
        Trainer(config, log=lambda _line: None)
    assert not dist.is_initialized()
    assert not model_parallel_is_initialized()


def test_a_run_closes_what_it_started(world: World, tmp_path: Path) -> None:
    trainer = Trainer(world_config(world, tmp_path, backend="megatron", device="cpu", steps=1), log=print)
    assert dist.is_initialized() and model_parallel_is_initialized()
    assert trainer.run().last_step == 1
    assert not dist.is_initialized()
    assert not model_parallel_is_initialized()
