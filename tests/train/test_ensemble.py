"""Several teachers for one token (issue 49, the kernel): the mixture target against a float64 reference
that materialises every teacher's distribution, and its identities."""

from __future__ import annotations

import itertools

import pytest
import torch

from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.ensemble import Member, mixture_divergence
from mopd.train.kernel.reference import reference_mixture
from tests.tolerance import assert_close, sum_rtol

N, V, STUDENT = 23, 97, 16
SIZES = (24, 40, 24)  # teacher hidden sizes: two of three differ
# Each output accumulates a side's logits (≤ 40 terms), a log-softmax over V = 97 columns, the mixture's
# log-sum-exp over ≤ 3 teachers and, for the head's gradient, a sum over N = 23 tokens: ≤ 163 roundings
# a side, twice over (the student's and the target's), normwise against float64.
RTOL = 2 * sum_rtol(40 + 97 + 3 + 23)


def ensemble_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, Member], dict[int, torch.Tensor]]:
    """A student, three teachers, and for each token a random non-empty set of them with random
    weights (some 0, never all of a token's)."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, STUDENT, generator=g)
    ws = torch.randn(V, STUDENT, generator=g) / STUDENT**0.5
    scores = torch.rand(N, len(SIZES), generator=g) < 0.6
    scores[torch.arange(N), torch.randint(0, len(SIZES), (N,), generator=g)] = True  # at least one
    members, heads = {}, {}
    for t, size in enumerate(SIZES):
        positions = scores[:, t].nonzero().flatten()
        weight = torch.rand(positions.shape[0], generator=g) + 0.1
        members[t] = Member(positions, torch.randn(positions.shape[0], size, generator=g), weight)
        heads[t] = torch.randn(V, size, generator=g) / size**0.5
    return hs, ws, members, heads


def fused(hs, ws, members, heads, **options):  # type: ignore[no-untyped-def]
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = mixture_divergence(hs, ws, members, heads, **options)
    out.loss.backward()
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


def reference(hs, ws, members, heads, **options):  # type: ignore[no-untyped-def]
    hs, ws = hs.double().requires_grad_(), ws.double().requires_grad_()
    given = {t: (m.positions, m.hidden.double(), m.weight.double()) for t, m in members.items()}
    out = reference_mixture(hs, ws, given, {t: h.double() for t, h in heads.items()}, **options)
    out.loss.backward()
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


@pytest.mark.parametrize(
    ("kind", "chunk", "temperature"), list(itertools.product(KINDS, [1, 7, 64], [1.0, 0.7]))
)
def test_the_mixture_equals_the_float64_reference(kind: str, chunk: int, temperature: float) -> None:
    """Loss, per-token values and both gradients, chunks below and above the token count."""
    hs, ws, members, heads = ensemble_case(seed=3)
    weights = torch.rand(N, generator=torch.Generator().manual_seed(4))
    options = dict(kind=kind, temperature=temperature, weights=weights / weights.sum())
    got = fused(hs, ws, members, heads, chunk_size=chunk, **options)
    want = reference(hs, ws, members, heads, **options)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, want, strict=True):
        assert_close(g, w, rtol=RTOL, norm=True, what=name)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mixture_of_a_teacher_with_itself_is_that_teacher(kind: str) -> None:
    hs, ws, _members, heads = ensemble_case(seed=5)
    every = torch.arange(N)
    hidden = torch.randn(N, SIZES[0], generator=torch.Generator().manual_seed(6))
    twice = {
        0: Member(every, hidden, torch.full((N,), 0.3)),
        1: Member(every, hidden, torch.full((N,), 0.7)),
    }
    got = fused(hs, ws, twice, {0: heads[0], 1: heads[0]}, kind=kind, chunk_size=7)
    alone = linear_divergence(
        hs.clone().requires_grad_(), ws, hidden, {0: heads[0]}, None, kind=kind, chunk_size=7
    )
    assert_close(got[1], alone.per_token, rtol=RTOL, norm=True, what="per_token")


def test_one_teacher_per_token_is_the_routed_divergence() -> None:
    """Tokens each scored by one teacher: the mixture is today's routing."""
    hs, ws, _members, heads = ensemble_case(seed=7)
    index = torch.randint(0, len(SIZES), (N,), generator=torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(9)
    alone = {}
    for t, size in enumerate(SIZES):
        positions = (index == t).nonzero().flatten()
        alone[t] = Member(
            positions, torch.randn(positions.shape[0], size, generator=g), torch.ones(len(positions))
        )
    got = fused(hs, ws, alone, heads, kind="reverse_kl", chunk_size=5)
    routed = linear_divergence(
        hs.clone().requires_grad_(),
        ws,
        {t: m.hidden for t, m in alone.items()},
        heads,
        index,
        kind="reverse_kl",
        chunk_size=5,
    )
    assert_close(got[1], routed.per_token, rtol=RTOL, norm=True, what="per_token")


def test_a_token_without_a_teacher_or_a_negative_weight_is_refused() -> None:
    hs, ws, members, heads = ensemble_case(seed=10)
    dropped = {
        t: Member(m.positions[m.positions != 0], m.hidden[m.positions != 0], m.weight[m.positions != 0])
        for t, m in members.items()
    }
    for combine in ("mixture", "sum", "min_ce"):
        with pytest.raises(ValueError, match="token 0 has no teacher; every token needs one"):
            mixture_divergence(
                hs, ws, dropped, heads, combine=combine, labels=torch.zeros(hs.shape[0], dtype=torch.long)
            )
    weightless = {t: Member(m.positions, m.hidden, torch.zeros_like(m.weight)) for t, m in members.items()}
    with pytest.raises(ValueError, match="token 0 has no teacher of positive weight"):
        mixture_divergence(hs, ws, weightless, heads)
    negative = {**members, 0: Member(members[0].positions, members[0].hidden, -members[0].weight)}
    with pytest.raises(ValueError, match="teacher 0 has a negative mixture weight"):
        mixture_divergence(hs, ws, negative, heads)
