"""`train.activation_checkpointing` on the hf backend: the decoder blocks keep only their inputs for the
backward and recompute the rest there, so the run trains the same values while autograd holds less (the
fsdp backend's run is in tests/distributed/test_train_fsdp.py; the peak resident memory it saves on
SmolLM2-135M is measured by bench/sharding.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from mopd.train.trainer import Trainer
from tests.tolerance import assert_same_training
from tests.train.test_precision import train_records
from tests.train.world import World, world_config


def saved_for_backward(world: World, folder: Path, recompute: bool) -> int:
    """Bytes autograd keeps for the backward after the forward of one microbatch (of 4 rows)."""
    config = world_config(world, folder, activation_checkpointing=recompute)
    with Trainer(config, log=lambda _l: None) as trainer:
        ids = torch.arange(4 * 90).reshape(4, 90) % 200
        kept = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal kept
            kept += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = trainer.student.hidden_states(ids, torch.ones_like(ids))
        hidden.sum().backward()
    return kept


def test_checkpointed_blocks_keep_less_for_the_backward(world: World, tmp_path: Path) -> None:
    whole = saved_for_backward(world, tmp_path / "whole", recompute=False)
    recomputed = saved_for_backward(world, tmp_path / "recomputed", recompute=True)
    # Each block keeps its input [4, 90, 64] (and the rotary tables) instead of every intermediate.
    assert recomputed * 4 < whole


def test_activation_checkpointing_trains_the_same_values(world: World, tmp_path: Path) -> None:
    plain = train_records(world, tmp_path / "plain")
    recomputed = train_records(world, tmp_path / "recomputed", activation_checkpointing=True)
    assert_same_training(recomputed, plain, layers=2, width=128)
