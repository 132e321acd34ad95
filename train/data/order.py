"""Which rows each data-parallel rank trains on, step by step: pure functions of
(row lengths, seed, epoch, dp_rank, dp_size) (DESIGN §7).

An epoch is a seeded permutation of all rows, cut into optimiser steps of about `global_batch_tokens`
tokens. Each step's rows are dealt to the DP ranks by a greedy token balance (longest first, to the rank
with the fewest tokens so far; ties to the lower rank), and each rank packs its share into microbatches
of at most `micro_batch_tokens` padded tokens. Every row is trained exactly once per epoch across ranks,
and a step is the same on every rank whatever the rank count, so the global batch does not depend on DP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mopd.base.batching import pack_batches


@dataclass(frozen=True)
class LoaderState:
    """What a checkpoint stores to resume the data order exactly."""

    seed: int
    epoch: int = 0
    step_in_epoch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> LoaderState:
        return cls(seed=int(data["seed"]), epoch=int(data["epoch"]), step_in_epoch=int(data["step_in_epoch"]))


def epoch_permutation(num_rows: int, *, seed: int, epoch: int) -> np.ndarray:
    """A permutation of all rows, different for every (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def epoch_steps(lengths: np.ndarray, *, seed: int, epoch: int, global_batch_tokens: int) -> list[np.ndarray]:
    """The epoch's optimiser steps: consecutive runs of the permutation of ≈ global_batch_tokens tokens.

    A step closes once adding the next row would exceed the budget (a longer row is a step of its own).
    """
    if global_batch_tokens <= 0:
        raise ValueError(f"global_batch_tokens must be positive, got {global_batch_tokens}")
    steps: list[np.ndarray] = []
    current: list[int] = []
    tokens = 0
    for row in epoch_permutation(lengths.shape[0], seed=seed, epoch=epoch):
        length = int(lengths[row])
        if current and tokens + length > global_batch_tokens:
            steps.append(np.array(current, dtype=np.int64))
            current, tokens = [], 0
        current.append(int(row))
        tokens += length
    if current:
        steps.append(np.array(current, dtype=np.int64))
    return steps


def rank_share(step_rows: np.ndarray, lengths: np.ndarray, *, dp_rank: int, dp_size: int) -> np.ndarray:
    """The rows of one step that `dp_rank` trains (greedy token balance; together, every row once)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    load = np.zeros(dp_size, dtype=np.int64)
    mine: list[int] = []
    for row in step_rows[np.lexsort((step_rows, -lengths[step_rows]))]:
        rank = int(np.argmin(load))
        load[rank] += lengths[row]
        if rank == dp_rank:
            mine.append(int(row))
    return np.array(sorted(mine), dtype=np.int64)


def rank_microbatches(
    step_rows: np.ndarray, lengths: np.ndarray, *, dp_rank: int, dp_size: int, micro_batch_tokens: int
) -> list[np.ndarray]:
    """This rank's share of a step, packed into microbatches padded only to their own longest row."""
    mine = rank_share(step_rows, lengths, dp_rank=dp_rank, dp_size=dp_size)
    if mine.shape[0] == 0:
        return []
    return pack_batches(mine, lengths[mine], batch_tokens=micro_batch_tokens)
