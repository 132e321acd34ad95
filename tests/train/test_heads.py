"""Teacher heads under each lifecycle: the right slice, one on the device at a time, reads accounted."""

from __future__ import annotations

import pytest
import torch

from mopd.store.reader import open_store
from mopd.train.heads import TeacherHeads
from tests.train.world import World


@pytest.mark.parametrize("lifecycle", ["none", "offload", "evict"])
def test_heads_serve_this_ranks_vocabulary_slice(world: World, lifecycle: str) -> None:
    store = open_store(world.store)
    vocab = store.teacher(0).vocab_size
    heads = TeacherHeads(
        store,
        [0, 1],
        lifecycle=lifecycle,
        device=torch.device("cpu"),
        vocab_start=vocab - 7,
        vocab_stop=vocab + 5,
    )
    for t in (0, 1):
        with heads.use(t) as head:
            assert torch.equal(head[:7], store.lm_head(t)[vocab - 7 :])
            assert head.shape[0] == 12 and not head[7:].any()  # a TP rank's padding rows are zeros
    assert heads.peak_resident == (2 if lifecycle == "none" else 1)
    assert heads.reads == {"none": 2, "offload": 2, "evict": 2}[lifecycle]


@pytest.mark.parametrize("lifecycle", ["offload", "evict"])
def test_a_second_head_cannot_join_the_first_on_the_device(world: World, lifecycle: str) -> None:
    heads = TeacherHeads(
        open_store(world.store),
        [0, 1],
        lifecycle=lifecycle,
        device=torch.device("cpu"),
        vocab_start=0,
        vocab_stop=8,
    )
    with heads.use(0), pytest.raises(RuntimeError, match="one at a time"), heads.use(1):
        pass
    with pytest.raises(KeyError, match="teacher 5 has no head"), heads.use(5):
        pass
    with pytest.raises(RuntimeError, match="keeps heads off the device"):
        heads.resident()
