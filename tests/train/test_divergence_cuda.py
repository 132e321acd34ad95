"""The kernel on a CUDA device against the fp64 reference on the CPU (bench/gpu.sh runs these).

Marked `gpu`: skipped where no CUDA device is (CI). The error model is the CPU tests': CUDA changes the
order of the sums, not how many roundings each output carries.
"""

from __future__ import annotations

import math

import pytest
import torch

from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.labels import linear_cross_entropy
from tests.tolerance import BF16_U, LAMBDA, U, assert_close, sum_rtol
from tests.train.allocations import PeakLiveBytes
from tests.train.divergence_cases import Case, logit_range, make_case, tvd_tie_atol
from tests.train.test_divergence import run_fused, run_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# (tokens, vocabulary, student width, chunk): the CPU tests' small case, and a wide vocabulary over
# several chunks, where the GPU's reductions split differently.
SHAPES = [(23, 97, 16, 7), (300, 32000, 256, 128)]


def rtol_of(case: Case) -> float:
    """As tests/train/test_divergence.py: two sides of ≤ (widest hidden + V + N) roundings each."""
    widest = max([case.student_hidden.shape[1]] + [h.shape[1] for h in case.teacher_hidden.values()])
    return 2 * sum_rtol(widest + case.student_head.shape[0] + case.student_hidden.shape[0])


def tie_atols(
    case: Case, kind: str, temperature: float = 1.0
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """atol of (grad_hidden, grad_head): TVD's gradient jumps at ties p_s = p_t, and entries within a
    probability's rounding error may take either sign. That error, estimated as the logit's and the
    normaliser's, λ·√(H + V)·U per unit of logit over the rows' span (1 + R), is the width of a tie."""
    if kind != "tvd":
        return 0.0, 0.0
    width, vocab = case.student_hidden.shape[1], case.student_head.shape[0]
    eps = LAMBDA * math.sqrt(width + vocab) * U * (1 + logit_range(case, temperature))
    return tvd_tie_atol(case, eps, temperature)


def on_cuda(case: Case, dtype: torch.dtype = torch.float32) -> Case:
    return case.to(dtype, device=CUDA)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-V{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_on_cuda_matches_fp64_reference(kind: str, shape: tuple[int, int, int, int]) -> None:
    n, vocab, width, chunk = shape
    case = make_case(num_tokens=n, vocab=vocab, student_size=width, teachers=3, softcap=True, seed=11)
    got = run_fused(on_cuda(case), kind=kind, temperature=0.7, chunk=chunk)
    want = run_reference(case, kind=kind, temperature=0.7)
    atols = (0.0, 0.0, *tie_atols(case, kind, temperature=0.7))
    names = ("loss", "per_token", "grad_hidden", "grad_head")
    for name, g, w, atol in zip(names, got, want, atols, strict=True):
        assert g.device.type == "cuda"
        assert_close(g, w, rtol=rtol_of(case), atol=atol, norm=True, what=name)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_on_cuda_carry_only_their_own_error(kind: str) -> None:
    n, vocab, width, chunk = SHAPES[1]
    case = make_case(num_tokens=n, vocab=vocab, student_size=width, teachers=3, softcap=True, seed=5)
    rounded = case.to(torch.bfloat16)
    got = run_fused(on_cuda(rounded, torch.bfloat16), kind=kind, chunk=chunk)
    want = run_reference(rounded, kind=kind)  # fp64 from the same bf16 values
    # bf16 × bf16 products are exact in fp32: values carry fp32 sums only; gradients come back in
    # bf16, one rounding more (a proven 2⁻⁸ relative), and TVD's may differ at ties (`tie_atols`).
    for name, g, w in zip(("loss", "per_token"), got[:2], want[:2], strict=True):
        assert_close(g, w, rtol=rtol_of(case), norm=True, what=name)
    ties = tie_atols(rounded, kind)
    for name, g, w, atol in zip(("grad_hidden", "grad_head"), got[2:], want[2:], ties, strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, w, rtol=BF16_U + rtol_of(case), atol=atol, norm=True, rigorous=True, what=name)


def test_hard_label_cross_entropy_on_cuda() -> None:
    n, vocab, width, chunk = SHAPES[1]
    case = make_case(num_tokens=n, vocab=vocab, student_size=width, seed=4)
    labels = torch.randint(0, vocab - 7, (n,), generator=torch.Generator().manual_seed(1))
    labels[3] = -100
    hs = case.student_hidden.detach().to(CUDA).requires_grad_()
    ws = case.student_head.detach().to(CUDA).requires_grad_()
    out = linear_cross_entropy(
        hs, ws, labels.to(CUDA), weights=case.weights.to(CUDA), chunk_size=chunk, vocab_size=vocab - 7
    )
    out.loss.backward()
    hs64 = case.student_hidden.detach().double().requires_grad_()
    ws64 = case.student_head.detach().double().requires_grad_()
    logits = (hs64 @ ws64.T)[:, : vocab - 7]
    per_token = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    (case.weights.double() * per_token).sum().backward()
    rtol = 2 * sum_rtol(width + vocab + n)
    assert_close(out.per_token, per_token, rtol=rtol, norm=True, what="per_token")
    assert_close(hs.grad, hs64.grad, rtol=rtol, norm=True, what="grad_hidden")
    assert_close(ws.grad, ws64.grad, rtol=rtol, norm=True, what="grad_head")


def test_cuda_and_cpu_agree_on_one_call() -> None:
    """The same fp32 call on both devices: within the error model of each (twice the bound)."""
    n, vocab, width, chunk = SHAPES[1]
    case = make_case(num_tokens=n, vocab=vocab, student_size=width, teachers=3, seed=8)

    def values(c: Case) -> torch.Tensor:
        student = (c.student_hidden.detach(), c.student_head.detach())
        teachers = (c.teacher_hidden, c.teacher_heads, c.teacher_index)
        return linear_divergence(*student, *teachers, chunk_size=chunk, weights=c.weights).per_token

    assert_close(values(on_cuda(case)), values(case), rtol=2 * rtol_of(case), norm=True, what="per_token")


def test_bf16_heads_are_never_copied_on_cuda() -> None:
    """Four bf16 teachers on CUDA: every GEMM takes the bf16 head as it is. The bound is the kernel's
    memory model without any [V, H] copy; one fp32 copy of one teacher head alone would break it."""
    n, vocab, hs_size, ht_size, chunk, teachers = 1024, 32768, 512, 4096, 256, 4
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(n, hs_size, generator=g).bfloat16().to(CUDA).requires_grad_()
    ws = (torch.randn(vocab, hs_size, generator=g) * 0.05).bfloat16().to(CUDA).requires_grad_()
    index = (torch.arange(n) % teachers).to(CUDA)
    hidden = {
        t: torch.randn(n // teachers, ht_size, generator=g).bfloat16().to(CUDA) for t in range(teachers)
    }
    heads = {
        t: (torch.randn(vocab, ht_size, generator=g) * 0.02).bfloat16().to(CUDA) for t in range(teachers)
    }
    with PeakLiveBytes() as record:
        out = linear_divergence(hs, ws, hidden, heads, index, chunk_size=chunk)
        out.loss.backward()
    fp32, bf16 = 4, 2
    student = (n + vocab) * hs_size * (fp32 + bf16)  # fp32 gradient accumulators, gradients saved in bf16
    chunk_buffers = 3 * chunk * vocab * fp32  # reverse KL's three [C, V] buffers
    temporaries = 2 * chunk * vocab * fp32 + chunk * (ht_size + hs_size) * fp32  # hi + lo, a [C, V] temp
    bound = student + chunk_buffers + temporaries
    assert bound < vocab * ht_size * fp32
    assert record.peak <= bound, (record.peak, bound)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_chain_on_cuda_matches_the_eager_one(kind: str) -> None:
    """bf16 inputs, a wide vocabulary over several chunks and a short last one."""
    n, vocab, width, chunk = SHAPES[1]
    case = on_cuda(
        make_case(num_tokens=n, vocab=vocab, student_size=width, teachers=3, seed=8), torch.bfloat16
    )
    eager = run_fused(case, kind=kind, chunk=chunk)
    compiled = run_fused(case, kind=kind, chunk=chunk, compiled=True)
    # The same operations with their reductions over V fused and reordered: λ·√V·U per sum, each side;
    # the gradients are then rounded to bf16 on each side: two nearby values may round to neighbours, one
    # ulp apart (2·BF16_U of the value); TVD's may also differ at ties (`tie_atols`).
    rtol = 2 * LAMBDA * math.sqrt(vocab) * U
    for name, c, e in zip(("loss", "per_token"), compiled[:2], eager[:2], strict=True):
        assert_close(c, e, rtol=rtol, norm=True, what=name)
    ties = tie_atols(case.to(torch.bfloat16, device="cpu"), kind)
    for name, c, e, atol in zip(("grad_hidden", "grad_head"), compiled[2:], eager[2:], ties, strict=True):
        assert_close(c, e, rtol=2 * BF16_U + rtol, atol=atol, norm=True, rigorous=True, what=name)


def test_compiled_hard_label_chain_on_cuda_matches_the_eager_one() -> None:
    n, vocab, width, chunk = SHAPES[1]
    case = make_case(num_tokens=n, vocab=vocab, student_size=width, seed=4)
    labels = torch.randint(0, vocab - 7, (n,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    labels[3] = -100

    def run(compiled: bool) -> list[torch.Tensor]:
        hs = case.student_hidden.detach().to(CUDA).requires_grad_()
        ws = case.student_head.detach().to(CUDA).requires_grad_()
        out = linear_cross_entropy(
            hs,
            ws,
            labels,
            weights=case.weights.to(CUDA),
            chunk_size=chunk,
            vocab_size=vocab - 7,
            compiled=compiled,
        )
        out.loss.backward()
        assert hs.grad is not None and ws.grad is not None
        return [out.loss.detach(), out.per_token, hs.grad, ws.grad]

    eager, compiled = run(False), run(True)
    rtol = 2 * LAMBDA * math.sqrt(vocab) * U  # one reduction over V, in two orders (fp32 inputs)
    for name, c, e in zip(("loss", "per_token", "grad_hidden", "grad_head"), compiled, eager, strict=True):
        assert_close(c, e, rtol=rtol, norm=True, what=name)
