"""The data order: every row exactly once per epoch across DP ranks, reproducible, resumable."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd.train.data.order import LoaderState, epoch_permutation, epoch_steps, rank_microbatches, rank_share

lengths_strategy = st.lists(st.integers(1, 500), min_size=1, max_size=80).map(np.array)


@settings(max_examples=200, deadline=None)
@given(
    lengths=lengths_strategy,
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    dp_size=st.integers(1, 5),
    budget=st.integers(1, 3000),
    micro=st.integers(1, 800),
)
def test_every_row_once_per_epoch_across_ranks(
    lengths: np.ndarray, seed: int, epoch: int, dp_size: int, budget: int, micro: int
) -> None:
    seen: list[int] = []
    for step in epoch_steps(lengths, seed=seed, epoch=epoch, global_batch_tokens=budget):
        assert lengths[step].sum() <= budget or step.shape[0] == 1
        shares = [rank_share(step, lengths, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        assert sorted(np.concatenate(shares).tolist()) == sorted(step.tolist())
        for rank in range(dp_size):
            batches = rank_microbatches(
                step, lengths, dp_rank=rank, dp_size=dp_size, micro_batch_tokens=micro
            )
            flat = np.concatenate(batches).tolist() if batches else []
            assert sorted(flat) == shares[rank].tolist()
            for batch in batches:  # padded only to the microbatch's own longest row
                assert lengths[batch].max() * batch.shape[0] <= micro or batch.shape[0] == 1
        seen += step.tolist()
    assert sorted(seen) == list(range(lengths.shape[0]))


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = epoch_permutation(100, seed=3, epoch=1)
    assert np.array_equal(a, epoch_permutation(100, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_permutation(100, seed=3, epoch=2))
    assert not np.array_equal(a, epoch_permutation(100, seed=4, epoch=1))


def test_steps_do_not_depend_on_dp_size() -> None:
    lengths = np.random.default_rng(0).integers(1, 300, size=200)
    steps = epoch_steps(lengths, seed=1, epoch=0, global_batch_tokens=2000)
    for dp_size in (1, 2, 4):
        union = [
            np.sort(
                np.concatenate([rank_share(s, lengths, dp_rank=r, dp_size=dp_size) for r in range(dp_size)])
            )
            for s in steps
        ]
        assert all(np.array_equal(u, np.sort(s)) for u, s in zip(union, steps, strict=True))


def test_ranks_get_balanced_tokens() -> None:
    lengths = np.random.default_rng(1).integers(1, 300, size=400)
    step = np.arange(400)
    loads = [lengths[rank_share(step, lengths, dp_rank=r, dp_size=4)].sum() for r in range(4)]
    assert max(loads) - min(loads) <= lengths.max()


def test_loader_state_round_trip() -> None:
    state = LoaderState(seed=5, epoch=2, step_in_epoch=17)
    assert LoaderState.from_dict(state.to_dict()) == state
