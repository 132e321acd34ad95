"""Acceptance: no tensor of N × V_local elements or more exists in the fused kernel, forward or backward."""

from __future__ import annotations

import torch

from mopd.train.kernel.divergence import linear_divergence
from mopd.train.kernel.reference import reference_divergence
from tests.train.allocations import LargestAllocation, PeakLiveBytes

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


def test_bf16_teacher_heads_are_upcast_one_at_a_time_on_cpu() -> None:
    """Four bf16 teachers: the call holds an fp32 copy of one teacher head at a time (the teacher whose
    tokens are in flight), not of every teacher present. The bound is the kernel's memory model; an
    implementation that upcast every head for the whole call would need three heads' copies more."""
    n, vocab, hs_size, ht_size, chunk, teachers = 1024, 8192, 128, 512, 256, 4
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(n, hs_size, generator=g).bfloat16().requires_grad_()
    ws = (torch.randn(vocab, hs_size, generator=g) * 0.1).bfloat16().requires_grad_()
    index = torch.arange(n) % teachers
    hidden = {t: torch.randn(n // teachers, ht_size, generator=g).bfloat16() for t in range(teachers)}
    heads = {t: (torch.randn(vocab, ht_size, generator=g) * 0.1).bfloat16() for t in range(teachers)}
    with PeakLiveBytes() as record:
        out = linear_divergence(hs, ws, hidden, heads, index, chunk_size=chunk)
        out.loss.backward()
    fp32, bf16 = 4, 2
    head_copy = vocab * ht_size * fp32
    student = (n + vocab) * hs_size * (2 * fp32 + 2 * bf16)  # fp32 operands and gradients, saved grads
    chunk_buffers = 3 * chunk * vocab * fp32  # reverse KL's three [C, V] buffers
    temporaries = chunk * vocab * fp32 + chunk * (ht_size + hs_size) * fp32  # one [C, V], a chunk's rows
    bound = student + chunk_buffers + temporaries + head_copy
    assert bound < record.peak + (teachers - 1) * head_copy  # every head upcast would exceed the bound
    assert record.peak <= bound, (record.peak, bound)
