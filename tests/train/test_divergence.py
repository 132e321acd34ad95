"""Acceptance: the fused kernel against an fp64 reference, self-distillation, and its input errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.labels import linear_cross_entropy
from mopd.train.kernel.reference import reference_divergence
from tests.tolerance import BF16_U, assert_close, sum_rtol, value_atol
from tests.train.divergence_cases import Case, logit_range, make_case

# Each output of the kernel accumulates a side's logits (dot products of ≤ 40 terms: the widest hidden
# size of these cases), a softmax over the V = 97 columns and, for the head's gradient, a sum over the
# N = 23 tokens: ≤ 160 roundings for each of the two sides. Normwise, against an fp64 reference.
KERNEL_RTOL = 2 * sum_rtol(40 + 97 + 23)


def run_fused(
    case: Case,
    *,
    kind: str,
    temperature: float = 1.0,
    chunk: int = 1024,
    beta: float = 0.5,
    hidden_as_tensor: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hs = case.student_hidden.detach().clone().requires_grad_()
    ws = case.student_head.detach().clone().requires_grad_()
    teacher_hidden = case.teacher_hidden
    if hidden_as_tensor:  # [N, Ht] form: only when every teacher has the same hidden size
        (size,) = {h.shape[1] for h in teacher_hidden.values()}
        full = torch.zeros(hs.shape[0], size, dtype=hs.dtype)
        for t, rows in teacher_hidden.items():
            full[case.teacher_index == t] = rows
        teacher_hidden = full  # type: ignore[assignment]
    out = linear_divergence(
        hs,
        ws,
        teacher_hidden,
        case.teacher_heads,
        case.teacher_index,
        kind=kind,
        beta=beta,
        temperature=temperature,
        weights=case.weights,
        chunk_size=chunk,
        teacher_transforms=case.transforms,
        compiled=compiled,
    )
    out.loss.backward()
    assert hs.grad is not None and ws.grad is not None
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


def run_reference(case: Case, *, kind: str, temperature: float = 1.0, beta: float = 0.5):  # type: ignore[no-untyped-def]
    c = case.to(torch.float64)
    out = reference_divergence(
        c.student_hidden,
        c.student_head,
        c.teacher_hidden,
        c.teacher_heads,
        c.teacher_index,
        kind=kind,
        beta=beta,
        temperature=temperature,
        weights=c.weights,
        teacher_transforms=c.transforms,
    )
    out.loss.backward()
    return out.loss.detach(), out.per_token, c.student_hidden.grad, c.student_head.grad


@pytest.mark.parametrize(
    ("kind", "temperature", "chunk", "teachers", "softcap"),
    list(itertools.product(KINDS, [1.0, 0.7], [1, 7, 64], [1, 3], [False, True])),
)
def test_fp32_matches_fp64_reference(
    kind: str, temperature: float, chunk: int, teachers: int, softcap: bool
) -> None:
    case = make_case(teachers=teachers, softcap=softcap, seed=teachers * 10 + softcap)
    got = run_fused(case, kind=kind, temperature=temperature, chunk=chunk)
    want = run_reference(case, kind=kind, temperature=temperature)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, want, strict=True):
        assert_close(g, w, rtol=KERNEL_RTOL, norm=True, what=name)


def test_teacher_hidden_as_one_tensor_equals_mapping() -> None:
    case = make_case(teachers=3)
    case.teacher_hidden[1] = case.teacher_hidden[1][:, :24]
    case.teacher_heads[1] = case.teacher_heads[1][:, :24]
    a = run_fused(case, kind="reverse_kl", chunk=5)
    b = run_fused(case, kind="reverse_kl", chunk=5, hidden_as_tensor=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_within_1e2(kind: str) -> None:
    case = make_case(teachers=3, softcap=True, seed=5).to(torch.bfloat16)
    got = run_fused(case, kind=kind, chunk=7)
    want = run_reference(case, kind=kind)  # fp64 from the same bf16 values
    # bf16 values are exact in fp32, so values and loss carry fp32 rounding only; the gradients come
    # back in the inputs' dtype: one bf16 rounding more, a proven worst case of 2⁻⁸ relative.
    for name, g, w in zip(("loss", "per_token"), got[:2], want[:2], strict=True):
        assert_close(g, w, rtol=KERNEL_RTOL, norm=True, what=name)
    for name, g, w in zip(("grad_hidden", "grad_head"), got[2:], want[2:], strict=True):
        assert_close(g, w, rtol=BF16_U + KERNEL_RTOL, norm=True, rigorous=True, what=name)


def test_logits_are_not_rounded_to_bf16() -> None:
    # Logits near 300 with differences of ~0.1: bf16 spacing there is 2.0, so rounding the logits to bf16
    # before the softmax would change the distributions completely.
    case = make_case(teachers=1, seed=7, scale=1.0)
    base_s = torch.full_like(case.student_head, 0.0)
    base_s[:, 0] = 1.0
    case.student_hidden = (
        torch.full_like(case.student_hidden, 0.0) + torch.randn_like(case.student_hidden) * 0.02
    ).requires_grad_()
    case.student_hidden.data[:, 0] = 300.0
    case.student_head = (base_s + torch.randn_like(base_s) * 0.002).requires_grad_()
    case = case.to(torch.bfloat16)
    fused = run_fused(case, kind="reverse_kl", chunk=7)
    want = run_reference(case, kind="reverse_kl")
    rounded = case.to(torch.float64)
    zs = (rounded.student_hidden @ rounded.student_head.T).to(torch.bfloat16).double()
    exact = rounded.student_hidden @ rounded.student_head.T
    # fp32 logits of 16-term dot products err by ≤ 16·U·|z| (|z| ≈ 300 here, ≈ 3e-4); a value moves by
    # at most twice its logits' error (both log-softmax terms): far below bf16's spacing of 2 at 300.
    assert_close(fused[1], want[1], atol=2 * 2 * sum_rtol(16) * float(exact.abs().max()), what="per_token")
    assert (zs - exact).abs().max() > 0.5  # the check above would have failed with bf16 logits


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
def test_self_distillation_is_zero(kind: str) -> None:
    case = make_case(teachers=1, student_size=24, seed=3)
    case.teacher_hidden = {0: case.student_hidden.detach().clone()}
    case.teacher_heads = {0: case.student_head.detach().clone()}
    _, per_token, grad_h, grad_w = run_fused(case, kind=kind, chunk=5)
    # Both sides round the same logits differently by ≤ δ = value_atol (per log-probability); the value
    # is within δ of 0 and a gradient within δ times the largest hidden or head entry.
    delta = value_atol(97, logit_range(case))
    scale = max(float(case.student_hidden.abs().max()), float(case.student_head.abs().max()))
    for name, value, bound in (
        ("per_token", per_token, delta),
        ("grad_hidden", grad_h, delta * scale),
        ("grad_head", grad_w, delta * scale),
    ):
        assert_close(value, torch.zeros_like(value), atol=bound, what=name)


def test_kl_is_cross_entropy_minus_entropy() -> None:
    case = make_case(teachers=3, softcap=True, seed=9)
    kl = run_fused(case, kind="reverse_kl", chunk=4)[1]
    ce = run_fused(case, kind="cross_entropy", chunk=4)[1]
    h = run_fused(case, kind="entropy", chunk=4)[1]
    # Three computations, each within half of value_atol (which bounds two).
    assert_close(kl, ce - h, atol=1.5 * value_atol(97, logit_range(case)), what="KL - (CE - H)")


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_degenerate_beta_is_zero(beta: float) -> None:
    case = make_case(teachers=3, seed=2)
    _, per_token, grad_h, grad_w = run_fused(case, kind="jsd", beta=beta, chunk=6)
    assert per_token.abs().max() == 0 and grad_h.abs().max() == 0 and grad_w.abs().max() == 0
    want = run_reference(case, kind="jsd", beta=beta)
    assert want[1].abs().max() <= 1e-12


def test_frozen_student_head_gets_no_gradient() -> None:
    case = make_case(teachers=1)
    hs = case.student_hidden.detach().clone().requires_grad_()
    out = linear_divergence(hs, case.student_head.detach(), case.teacher_hidden, case.teacher_heads, None)
    out.loss.backward()
    assert hs.grad is not None and hs.grad.abs().max() > 0


def call(case: Case, **changes):  # type: ignore[no-untyped-def]
    args = {
        "student_hidden": case.student_hidden,
        "student_head": case.student_head,
        "teacher_hidden": case.teacher_hidden,
        "teacher_heads": case.teacher_heads,
        "teacher_index": case.teacher_index,
        **changes,
    }
    return linear_divergence(**args)


def test_input_errors_name_the_problem() -> None:
    case = make_case(teachers=3)
    with pytest.raises(ValueError, match=r"routed to teacher 2, but no head was given"):
        call(case, teacher_heads={0: case.teacher_heads[0], 1: case.teacher_heads[1]})
    with pytest.raises(ValueError, match=r"teacher_index is required when 3 teacher heads"):
        call(case, teacher_index=None)
    with pytest.raises(ValueError, match=r"teacher_index has shape \(22,\), expected \(23,\)"):
        call(case, teacher_index=case.teacher_index[:-1])
    with pytest.raises(ValueError, match=r"same local vocabulary size and dtype"):
        call(case, teacher_heads={**case.teacher_heads, 1: case.teacher_heads[1][:-1]})
    with pytest.raises(ValueError, match=r"same local vocabulary size and dtype"):
        call(case, teacher_heads={**case.teacher_heads, 1: case.teacher_heads[1].double()})
    with pytest.raises(ValueError, match=r"student and teachers must share the vocabulary"):
        call(case, student_head=case.student_head[:-1])
    with pytest.raises(ValueError, match=r"teacher 1: \d+ hidden rows for \d+ routed tokens"):
        call(case, teacher_hidden={**case.teacher_hidden, 1: case.teacher_hidden[1][:-1]})
    with pytest.raises(ValueError, match=r"kind 'kl' is not one of"):
        call(case, kind="kl")


def test_no_grad_evaluation_gives_the_same_values() -> None:
    case = make_case(teachers=3, softcap=True)
    with_grad = run_fused(case, kind="jsd", chunk=5)[1]
    with torch.no_grad():
        out = call(case, kind="jsd", chunk_size=5, teacher_transforms=case.transforms)
    assert torch.equal(out.per_token, with_grad) and out.loss.grad_fn is None


def test_frozen_hidden_gives_head_gradient_only() -> None:
    case = make_case(teachers=1)
    ws = case.student_head.detach().clone().requires_grad_()
    out = linear_divergence(
        case.student_hidden.detach(), ws, case.teacher_hidden, case.teacher_heads, None, weights=case.weights
    )
    out.loss.backward()
    want = run_reference(case, kind="reverse_kl")[3]
    assert_close(ws.grad, want, rtol=KERNEL_RTOL, norm=True, what="grad_head")


@pytest.mark.parametrize("vocab_size", [97, 90])
def test_hard_label_cross_entropy_matches_torch(vocab_size: int) -> None:
    """Values and both gradients equal autograd through materialised logits (float64 reference); with
    vocab_size < rows of the head, the padded columns are excluded."""
    case = make_case(vocab=97, num_tokens=23, seed=4)
    labels = torch.randint(0, vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    labels[3] = -100
    hs = case.student_hidden.detach().clone().requires_grad_()
    ws = case.student_head.detach().clone().requires_grad_()
    out = linear_cross_entropy(
        hs, ws, labels, weights=case.weights, temperature=1.3, chunk_size=5, vocab_size=vocab_size
    )
    out.loss.backward()
    hs64 = case.student_hidden.detach().double().requires_grad_()
    ws64 = case.student_head.detach().double().requires_grad_()
    logits = (hs64 @ ws64.T)[:, :vocab_size] / 1.3
    per_token = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    (case.weights.double() * per_token).sum().backward()
    assert_close(out.per_token, per_token, rtol=KERNEL_RTOL, norm=True, what="per_token")
    assert_close(hs.grad, hs64.grad, rtol=KERNEL_RTOL, norm=True, what="grad_hidden")
    assert_close(ws.grad, ws64.grad, rtol=KERNEL_RTOL, norm=True, what="grad_head")
    assert out.per_token[3] == 0.0
    with pytest.raises(ValueError, match="vocabulary size"):
        linear_cross_entropy(hs, ws, torch.full((23,), vocab_size), vocab_size=vocab_size)
