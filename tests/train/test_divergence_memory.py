"""Acceptance: no tensor of N × V_local elements or more exists in the fused kernel, forward or backward."""

from __future__ import annotations

import torch

from mopd.train.divergence import linear_divergence
from mopd.train.divergence_reference import reference_divergence
from tests.train.allocations import LargestAllocation

N, V, HS, HT, CHUNK = 4096, 8192, 64, 96, 256


def inputs(teachers: int) -> tuple:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(N, HS, generator=g).requires_grad_()
    ws = (torch.randn(V, HS, generator=g) * 0.1).requires_grad_()
    index = torch.randint(0, teachers, (N,), generator=g)
    hidden = {t: torch.randn(int((index == t).sum()), HT, generator=g) for t in range(teachers)}
    heads = {t: torch.randn(V, HT, generator=g) * 0.1 for t in range(teachers)}
    return hs, ws, hidden, heads, index


def test_fused_kernel_never_allocates_tokens_by_vocab() -> None:
    for teachers in (1, 3):
        hs, ws, hidden, heads, index = inputs(teachers)
        with LargestAllocation() as record:
            out = linear_divergence(hs, ws, hidden, heads, index, chunk_size=CHUNK)
            out.loss.backward()
        assert hs.grad is not None and ws.grad is not None
        assert record.largest < N * V, (record.largest, record.largest_op)
        assert record.largest >= CHUNK * V  # the chunk's logits, as expected: the mode sees allocations


def test_the_check_catches_a_materialising_implementation() -> None:
    hs, ws, hidden, heads, index = inputs(1)
    with LargestAllocation() as record:
        reference_divergence(hs, ws, hidden, heads, index).loss.backward()
    assert record.largest >= N * V
