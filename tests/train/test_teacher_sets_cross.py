"""A teacher of another vocabulary among a token's teachers (issue 49 with issue 47's projection: project
first, then combine): each `train.ensemble.method` against the float64 reference that projects every such
teacher's distribution densely, and the identity that ties a set of one such teacher to its routed run."""

from __future__ import annotations

import itertools

import pytest
import torch

from mopd.tokens.projection import Projection
from mopd.train.ensembles import METHODS
from mopd.train.kernel.divergence import KINDS
from mopd.train.kernel.projected import projected_divergence
from tests.tolerance import assert_close, sum_rtol
from tests.train.test_teacher_sets import SIZES, WEIGHTS, N, V, case, fused, options, reference

CROSS, TEACHER_VOCAB, UNREACHED = 2, 61, 7  # teacher 2 speaks 61 tokens; 7 student tokens get none
# As test_teacher_sets.RTOL, with the projected teacher's log-softmax over its 61 tokens and a
# log-sum-exp over the ≤ 2 entries that land on a student token.
RTOL = 2 * sum_rtol(40 + 2 * 97 + 61 + 2 + 3 + 29)


def projection(seed: int) -> Projection:
    """Each of the teacher's tokens onto one student token of the first V − UNREACHED, every third also
    onto a second (a third of its mass)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, V - UNREACHED, (TEACHER_VOCAB,), generator=g)
    second = torch.randint(0, V - UNREACHED, (TEACHER_VOCAB,), generator=g)
    split = torch.arange(TEACHER_VOCAB) % 3 == 0
    source = torch.cat([torch.arange(TEACHER_VOCAB), torch.arange(TEACHER_VOCAB)[split]])
    target = torch.cat([first, second[split]])
    weight = torch.cat([torch.where(split, 2 / 3, 1.0), torch.full((int(split.sum()),), 1 / 3)])
    order = torch.argsort(source, stable=True)
    out = Projection(source[order], target[order], weight[order].float(), TEACHER_VOCAB, V)
    out.check()
    return out


def cross_case(seed: int, sets: list[tuple[int, ...]] | None = None):  # type: ignore[no-untyped-def]
    """`test_teacher_sets.case` with teacher 2 of another vocabulary: its head of 61 tokens and 2 rows
    of padding past them (large noise the kernel must not read)."""
    hs, ws, mb, heads = case(seed, sets)
    if CROSS in heads:
        g = torch.Generator().manual_seed(seed + 100)
        head = torch.randn(TEACHER_VOCAB + 2, SIZES[CROSS], generator=g) * 2 / SIZES[CROSS] ** 0.5
        head[TEACHER_VOCAB:] *= 100.0
        heads[CROSS] = head
    return hs, ws, mb, heads, {CROSS: projection(seed)}


@pytest.mark.parametrize(
    ("method", "kind", "temperature"),
    list(itertools.product(METHODS, KINDS, [1.0])) + [(m, "reverse_kl", 0.7) for m in METHODS],
)
def test_each_method_with_a_teacher_of_another_vocabulary_equals_the_float64_reference(
    method: str, kind: str, temperature: float
) -> None:
    """Random sets of three teachers, one of another vocabulary: some tokens have it alone (their
    divergence runs over the student tokens it reaches), some with others (every student token);
    chunks of 7 tokens below N, at T = 1 and 0.7 (the projected teacher tempered before its projection)."""
    hs, ws, mb, heads, projections = cross_case(seed=21)
    assert mb.teacher_set is not None
    alone = int((mb.teacher_set == 1 << CROSS).sum())
    assert alone and int(((mb.teacher_set >> CROSS) & 1).sum()) > alone  # both kinds of token occur
    norm = torch.rand(N, generator=torch.Generator().manual_seed(4)) / N
    got = fused(method, hs, ws, mb, heads, norm, projections, **options(kind, 7, temperature))
    want = reference(method, hs, ws, mb, heads, norm, kind, temperature, projections)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, want, strict=True):
        assert_close(g, w, rtol=RTOL, norm=True, what=f"{method} {name}")


@pytest.mark.parametrize("method", ["mixture", "min_ce", "confidence"])
def test_a_set_of_one_teacher_of_another_vocabulary_is_its_routed_run(method: str) -> None:
    """Every token scored by the projected teacher alone: each method is the routed projected kernel's
    run (weight w_2 on every token), to the rounding of the mixture's extra log-softmax."""
    hs, ws, mb, heads, projections = cross_case(seed=22, sets=[(CROSS,)] * N)
    norm = torch.full((N,), 1.0 / N)
    settings = options("reverse_kl", 7, 1.0)
    got = fused(method, hs, ws, mb, heads, norm, projections, **settings)
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    settings.pop("compiled")
    out = projected_divergence(
        hs,
        ws,
        mb.teacher_hidden[CROSS],
        heads[CROSS],
        projections[CROSS],
        weights=norm * WEIGHTS[CROSS],
        **settings,
    )
    out.loss.backward()
    alone = (out.loss.detach(), out.per_token, hs.grad, ws.grad)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, alone, strict=True):
        assert_close(g, w, rtol=RTOL, norm=True, what=f"{method} {name}")
