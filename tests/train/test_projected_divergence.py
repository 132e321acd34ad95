"""Divergences against a teacher of another vocabulary (mopd.train.kernel.projected): every kind
against a float64 reference that materialises the teacher's softmax and projects it densely; a
permuted vocabulary against the same-tokenizer kernel; projected distributions summing to 1 where the
teacher's tail underflows fp32."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from mopd.store.format.transform import LogitTransform
from mopd.tokens.projection import Projection
from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.projected import (
    LocalProjection,
    project_log_probs,
    projected_divergence,
    reference_projected_divergence,
)
from tests.tolerance import assert_close, sum_rtol, value_atol

TEMPERATURE = 0.7


@dataclass
class CrossCase:
    student_hidden: torch.Tensor  # [N, Hs]
    student_head: torch.Tensor  # [Vs, Hs]
    teacher_hidden: torch.Tensor  # [N, Ht]
    teacher_head: torch.Tensor  # [Vt (+ padding rows), Ht]
    projection: Projection
    weights: torch.Tensor  # [N]
    transform: LogitTransform


def cross_case(
    *, seed: int = 0, student_vocab: int = 41, teacher_vocab: int = 59, peak: float = 30.0
) -> CrossCase:
    """A teacher of 59 tokens onto a student of 41 (5 of which no teacher token reaches), some teacher
    tokens split over two student tokens; the teacher's logits span hundreds (`peak`), so its tail
    probabilities underflow fp32, and its head has 3 padding rows of large noise past its vocabulary."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, hs, ht = 17, 12, 10
    first = torch.randint(0, student_vocab - 5, (teacher_vocab,), generator=g)
    split = torch.arange(teacher_vocab) % 4 == 0  # every fourth teacher token: a second image, 1/3 to it
    second = torch.randint(0, student_vocab - 5, (teacher_vocab,), generator=g)
    source = torch.cat([torch.arange(teacher_vocab), torch.arange(teacher_vocab)[split]])
    target = torch.cat([first, second[split]])
    weight = torch.cat([torch.where(split, 2 / 3, 1.0), torch.full((int(split.sum()),), 1 / 3)])
    order = torch.argsort(source, stable=True)
    projection = Projection(source[order], target[order], weight[order].float(), teacher_vocab, student_vocab)
    projection.check()
    head = torch.randn(teacher_vocab + 3, ht, generator=g) * peak / ht**0.5
    head[teacher_vocab:] *= 100.0
    weights = torch.rand(num_tokens, generator=g) * (torch.rand(num_tokens, generator=g) > 0.2)
    return CrossCase(
        student_hidden=torch.randn(num_tokens, hs, generator=g),
        student_head=torch.randn(student_vocab, hs, generator=g) / hs**0.5,
        teacher_hidden=torch.randn(num_tokens, ht, generator=g),
        teacher_head=head,
        projection=projection,
        weights=weights / weights.sum(),
        transform=LogitTransform(logit_scale=1.25),
    )


def logit_range(case: CrossCase) -> float:
    """The largest gap between two logits of a row, either side, tempered (tests/tolerance.value_atol)."""
    zs = case.student_hidden.double() @ case.student_head.double().T
    zt = case.transform.apply(
        case.teacher_hidden.double() @ case.teacher_head[: case.projection.teacher_vocab].double().T
    )
    return max(float((z.amax(1) - z.amin(1)).max()) for z in (zs, zt)) / TEMPERATURE


def value_bound(case: CrossCase) -> float:
    """One token's value in fp32: three log-sum-exps round in sequence — the teacher's softmax over
    its Vt tokens, the projection's per-column sum over at most Vt entries, the student's softmax over
    Vs — so their roundings add: `value_atol` over Vt · Vt · Vs terms (⌈log₂⌉ of a product is the sum of
    the ⌈log₂⌉s, to one)."""
    p = case.projection
    return value_atol(p.teacher_vocab**2 * p.student_vocab, logit_range(case))


def run(
    case: CrossCase, kind: str, *, chunk_size: int = 5, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    hs = case.student_hidden.detach().to(dtype).clone().requires_grad_()
    ws = case.student_head.detach().to(dtype).clone().requires_grad_()
    args = (hs, ws, case.teacher_hidden.to(dtype), case.teacher_head.to(dtype), case.projection)
    common = {
        "kind": kind,
        "temperature": TEMPERATURE,
        "weights": case.weights.to(dtype),
        "teacher_transform": case.transform,
    }
    if dtype == torch.float64:
        out = reference_projected_divergence(*args, **common)
    else:
        out = projected_divergence(*args, chunk_size=chunk_size, **common)
    out.loss.backward()
    assert hs.grad is not None and ws.grad is not None
    return {
        "loss": out.loss.detach(),
        "per_token": out.per_token,
        "grad_hidden": hs.grad,
        "grad_head": ws.grad,
    }


def assert_matches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], case: CrossCase, what: str
) -> None:
    """Values within `value_bound`. A gradient is Σ_k scale·p_s,k·(u_k − ⟨p_s, u⟩)·(the other GEMM
    operand), where u carries the log-probabilities' error (≤ the value bound): ≤ 2·bound·weight/T times
    the operand's largest entry, per token, plus the GEMMs' own roundings (sums of ≤ Vs + N terms)."""
    bound = value_bound(case)
    assert_close(got["loss"], want["loss"], atol=bound, what=f"{what} loss")
    assert_close(got["per_token"], want["per_token"], atol=bound, what=f"{what} per_token")
    scale = 2 * bound * float(case.weights.max()) / TEMPERATURE
    rtol = sum_rtol(case.student_head.shape[0] + case.student_hidden.shape[0])
    for name, operand in (("grad_hidden", case.student_head), ("grad_head", case.student_hidden)):
        atol = (
            scale * float(operand.abs().max()) * (case.student_hidden.shape[0] if name == "grad_head" else 1)
        )
        assert_close(got[name], want[name], atol=atol, rtol=rtol, norm=True, what=f"{what} {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_equals_the_float64_dense_projection(kind: str) -> None:
    """Chunks of 5 tokens, below both vocabularies; the student tokens no teacher token reaches get no
    gradient, the values are finite although the teacher's tail probabilities underflow fp32."""
    case = cross_case()
    zt = case.transform.apply(case.teacher_hidden @ case.teacher_head[:59].T) / TEMPERATURE
    assert (zt.softmax(1) == 0).any()  # the tail underflows fp32: a linear-space projection would give log 0
    got, want = run(case, kind), run(case, kind, dtype=torch.float64)
    assert torch.isfinite(got["per_token"]).all()
    assert_matches(got, want, case, kind)
    assert (got["grad_head"][~case.projection.reached()] == 0).all()


def permuted(seed: int = 3, vocab: int = 53) -> tuple[CrossCase, torch.Tensor]:
    """A teacher that is a same-vocabulary teacher with its token ids permuted (head rows to match), and
    the permutation's projection: teacher token j is student token perm[j]."""
    case = cross_case(seed=seed, student_vocab=vocab, teacher_vocab=vocab, peak=3.0)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    assert not torch.equal(perm, torch.arange(vocab))  # the permutation goes through the projection
    head = case.teacher_head[:vocab]  # in the student's order
    case.teacher_head = head[perm]  # row j of the permuted head is the student's token perm[j]
    case.projection = Projection(torch.arange(vocab), perm, torch.ones(vocab), vocab, vocab)
    return case, head


@pytest.mark.parametrize("kind", KINDS)
def test_a_permuted_vocabulary_gives_the_same_tokenizer_losses(kind: str) -> None:
    """Through the projection, a permuted teacher gives the losses and gradients of the same teacher
    unpermuted through `linear_divergence`: both are fp32 computations of one quantity (value_bound)."""
    case, head = permuted()
    got = run(case, kind)
    hs = case.student_hidden.clone().requires_grad_()
    ws = case.student_head.clone().requires_grad_()
    out = linear_divergence(
        hs,
        ws,
        case.teacher_hidden,
        {0: head},
        None,
        kind=kind,
        temperature=TEMPERATURE,
        weights=case.weights,
        chunk_size=7,
        teacher_transforms={0: case.transform},
    )
    out.loss.backward()
    want = {
        "loss": out.loss.detach(),
        "per_token": out.per_token,
        "grad_hidden": hs.grad,
        "grad_head": ws.grad,
    }
    assert_matches(got, want, case, f"permuted {kind}")  # type: ignore[arg-type]


def test_projected_distributions_sum_to_one_where_the_tail_underflows() -> None:
    """Every teacher token projected (rows summing to 1): each row of p̃ sums to 1 within the roundings
    of two log-sum-exps over Vt terms, and every column's log-probability is finite, however far below
    fp32's range its probability lies."""
    case = cross_case()
    p = case.projection
    first = torch.unique(p.target)
    full = Projection(p.source, p.target, p.weight, p.teacher_vocab, int(first.max()) + 1)
    logits = case.teacher_hidden @ case.teacher_head[: p.teacher_vocab].T
    logp = logits.log_softmax(1)
    assert float(logp.min()) < -110  # below fp32's smallest subnormal, e^-103.3
    local = LocalProjection.of(
        full, vocab_start=0, local_vocab=full.student_vocab, device=torch.device("cpu")
    )
    out = project_log_probs(logp.T.contiguous(), local, torch.empty(logp.shape[0], full.student_vocab))
    reached = local.reached
    assert torch.isfinite(out[:, reached]).all() and (out[:, ~reached] == float("-inf")).all()
    total = torch.logsumexp(out.double(), 1)
    roundings = 2 * (math.ceil(math.log2(p.teacher_vocab)) + 3)
    assert_close(total, torch.zeros_like(total), atol=roundings * 2.0**-24, what="log Σ p̃")


def test_tensor_parallel_slices_project_onto_their_columns_only() -> None:
    """Each student slice's projection holds the entries landing in it, renumbered to local columns."""
    p = cross_case().projection
    halves = [
        LocalProjection.of(p, vocab_start=s, local_vocab=21, device=torch.device("cpu")) for s in (0, 21)
    ]
    assert sum(h.single_source.shape[0] + h.multi_source.shape[0] for h in halves) == p.source.shape[0]
    assert torch.equal(torch.cat([h.reached for h in halves])[:41], p.reached())
    assert all(int(torch.cat([h.single_column, h.multi_columns]).max()) < 21 for h in halves)
    assert all(h.single_source.numel() and h.multi_source.numel() for h in halves)  # both paths run


def test_mismatched_inputs_are_refused() -> None:
    case = cross_case()
    with pytest.raises(ValueError, match="maps onto 41 student tokens, the vocabulary has 40"):
        projected_divergence(
            case.student_hidden,
            case.student_head[:40],
            case.teacher_hidden,
            case.teacher_head,
            case.projection,
        )
    with pytest.raises(ValueError, match="teacher_hidden has 16 rows, student_hidden 17"):
        projected_divergence(
            case.student_hidden,
            case.student_head,
            case.teacher_hidden[:16],
            case.teacher_head,
            case.projection,
        )
    with pytest.raises(ValueError, match="the teacher head has 58 rows, the projection maps 59 tokens"):
        projected_divergence(
            case.student_hidden,
            case.student_head,
            case.teacher_hidden,
            case.teacher_head[:58],
            case.projection,
        )


def test_span_likelihood_match_equals_autograd_in_float64() -> None:
    """The span loss and its gradients against log_softmax + gather + sums under float64 autograd: the
    student's log-probabilities round as one token's hard-label value (`value_atol` over Vs, summed over
    a span's ≤ 4 tokens), the teacher's likewise over Vt."""
    from mopd.train.kernel.spans import span_likelihood_match, span_sums, teacher_log_probs

    case = cross_case()
    g = torch.Generator().manual_seed(9)
    num_tokens, vs = case.student_hidden.shape[0], case.student_head.shape[0]
    targets = torch.randint(0, vs, (num_tokens,), generator=g)
    span_of = torch.tensor([0, 0, 1, -1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 6, 6, -1, 7])
    teacher_targets = torch.randint(0, 59, (num_tokens,), generator=g)
    teacher_span = torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 5, 6, 7, -1, -1, 2, 4, 6, 7])
    span_weights = torch.rand(8, generator=g)
    teacher_lp = teacher_log_probs(
        case.teacher_hidden, case.teacher_head[:59], teacher_targets, transform=case.transform, chunk_size=4
    )
    teacher_ll = span_sums(teacher_lp, teacher_span, 8)
    hs = case.student_hidden.clone().requires_grad_()
    ws = case.student_head.clone().requires_grad_()
    out = span_likelihood_match(hs, ws, targets, span_of, teacher_ll, span_weights, chunk_size=5)
    out.loss.backward()

    hs64 = case.student_hidden.double().requires_grad_()
    ws64 = case.student_head.double().requires_grad_()
    lp = (hs64 @ ws64.T).log_softmax(1).gather(1, targets[:, None])[:, 0]
    tz = case.transform.apply(case.teacher_hidden.double() @ case.teacher_head[:59].double().T)
    tlp = tz.log_softmax(1).gather(1, teacher_targets[:, None])[:, 0]
    gap = torch.zeros(8, dtype=torch.float64).index_add(0, span_of[span_of >= 0], lp[span_of >= 0])
    gap = gap - torch.zeros(8, dtype=torch.float64).index_add(
        0, teacher_span[teacher_span >= 0], tlp[teacher_span >= 0]
    )
    want = (span_weights.double() * 0.5 * gap.square()).sum()
    want.backward()
    zs = case.student_hidden.double() @ case.student_head.double().T
    bound = 4 * (
        value_atol(vs, float((zs.amax(1) - zs.amin(1)).max()))
        + value_atol(59, float((tz.amax(1) - tz.amin(1)).max()))
    )
    assert_close(
        out.per_token,
        0.5 * gap.detach().square(),
        atol=bound * float(gap.detach().abs().max() + bound),
        what="per span",
    )
    assert_close(
        out.loss,
        want,
        atol=bound * float((span_weights * gap.detach().abs().float()).sum() + bound),
        what="span loss",
    )
    scale = bound * float(span_weights.max())  # each token's weight w·gap, off by ≤ w·bound
    for name, got, ref, operand in (
        ("grad_hidden", hs.grad, hs64.grad, case.student_head),
        ("grad_head", ws.grad, ws64.grad, case.student_hidden),
    ):
        atol = 2 * scale * float(operand.abs().max()) * (num_tokens if name == "grad_head" else 1)
        assert_close(got, ref, atol=atol, rtol=sum_rtol(vs + num_tokens), norm=True, what=name)


def test_span_chunks_end_where_spans_do() -> None:
    """Chunks of at most 4 tokens over spans of 1 to 6 tokens: each chunk starts a span and is as long
    as whole spans within 4 tokens allow; a span longer than 4 tokens is a chunk of its own."""
    from mopd.train.kernel.spans import span_chunks

    span_of = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 4, 5, 5])
    starts = span_chunks(span_of, 4)
    assert starts == (0, 2, 6, 12)
    assert span_chunks(span_of, 100) == (0,) and span_chunks(torch.zeros(0, dtype=torch.long), 4) == ()
