"""No training microbatch allocates tokens × vocab, for the student or any teacher (issue 5, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mopd.train.data.order import LoaderState
from mopd.train.trainer import Trainer
from tests.train.allocations import LargestVocabAllocation
from tests.train.world import World, world_config

CHUNK = 32


@pytest.mark.parametrize("lifecycle", ["none", "offload"])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_a_training_step_never_allocates_tokens_by_vocab(
    world: World, tmp_path: Path, lifecycle: str, ce_weight: float
) -> None:
    config = world_config(
        world,
        tmp_path,
        lm_head_lifecycle=lifecycle,
        divergence={"chunk_size": CHUNK, "ce_weight": ce_weight},
        batch={"micro_batch_tokens": 4096, "global_batch_tokens": 2048},  # one microbatch per step
    )
    trainer = Trainer(config, log=lambda _line: None)
    vocab, hidden = trainer.student.head.shape
    step = next(trainer.loader.steps(LoaderState(trainer.tc.seed)))
    smallest_microbatch = min(mb.num_trained for mb in step.microbatches)
    # Any [tokens, V] tensor of any microbatch would break the bound below.
    assert smallest_microbatch * vocab > 2 * max(CHUNK * vocab, vocab * hidden), smallest_microbatch
    with LargestVocabAllocation(vocab) as seen:
        trainer.train_step(1, step)
    # Chunk buffers [chunk, V] and head-shaped tensors [V, H] (weights, gradients, AdamW moments) only.
    assert seen.largest <= max(CHUNK * vocab, vocab * hidden), seen.largest_shape


def test_the_check_catches_materialised_logits(world: World, tmp_path: Path) -> None:
    """Control: the student's own forward (what mopd bypasses) forms [B, L, V] logits and is caught."""
    trainer = Trainer(world_config(world, tmp_path), log=lambda _line: None)
    mb = next(trainer.loader.steps(LoaderState(trainer.tc.seed))).microbatches[0]
    vocab = trainer.student.head.shape[0]
    with torch.no_grad(), LargestVocabAllocation(vocab) as seen:
        trainer.student.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    assert seen.largest >= mb.input_ids.numel() * vocab
