"""Tokens of several teachers (issue 49): each `train.ensemble.method` against a float64 reference that
materialises every teacher's distribution (`reference_ensemble`, written from DESIGN §14's definitions),
and the identities that tie the methods to one-teacher training."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from mopd.store.format.layout import set_mask
from mopd.store.format.transform import LogitTransform
from mopd.train.data.loader import IGNORE, MicroBatch
from mopd.train.ensembles import METHODS, ensemble_loss
from mopd.train.kernel.divergence import KINDS, linear_divergence
from mopd.train.kernel.reference import reference_ensemble
from tests.tolerance import assert_close, sum_rtol

N, V, STUDENT = 29, 97, 16
SIZES = (24, 40, 24)  # teacher hidden sizes: two of three differ
WEIGHTS = torch.tensor([1.0, 0.5, 2.0])
# As tests/train/test_ensemble.py: ≤ 40 terms a logit, a log-softmax over V = 97, a mix of ≤ 3 teachers,
# a sum over N = 29 tokens for the head's gradient; twice (the student's side and the target's).
# `confidence` adds each teacher's top log-probability (another log-softmax over V) to its weight.
RTOL = 2 * sum_rtol(40 + 2 * 97 + 3 + 29)


def case(
    seed: int, sets: list[tuple[int, ...]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, MicroBatch, dict]:
    """A student, three teachers and a microbatch of N tokens, each of a random set of them (or
    `sets[n]`); a few tokens have no next token."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, STUDENT, generator=g)
    ws = torch.randn(V, STUDENT, generator=g) / STUDENT**0.5
    if sets is None:
        draws = torch.rand(N, len(SIZES), generator=g) < 0.5
        draws[torch.arange(N), torch.randint(0, len(SIZES), (N,), generator=g)] = True
        sets = [tuple(t for t in range(len(SIZES)) if draws[n, t]) for n in range(N)]
    teacher_set = torch.tensor([set_mask(s) for s in sets], dtype=torch.long)
    heads, hidden = {}, {}
    for t, size in enumerate(SIZES):
        scored = int(((teacher_set >> t) & 1).sum())
        if scored:
            hidden[t] = torch.randn(scored, size, generator=g) * 2
            heads[t] = torch.randn(V, size, generator=g) / size**0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[4, 17]] = IGNORE
    mb = MicroBatch(
        rows=np.zeros(1, dtype=np.int64),
        input_ids=torch.zeros(1, N, dtype=torch.long),
        attention_mask=torch.ones(1, N, dtype=torch.long),
        loss_mask=torch.ones(1, N, dtype=torch.bool),
        teacher_index=torch.tensor([min(s) for s in sets]),
        token_row=torch.zeros(N, dtype=torch.long),
        labels=labels,
        teacher_hidden=hidden,
        teacher_set=teacher_set,
    )
    return hs, ws, mb, heads


def options(kind: str, chunk: int, temperature: float) -> dict[str, Any]:
    return dict(
        kind=kind,
        beta=0.5,
        temperature=temperature,
        chunk_size=chunk,
        compiled=False,
        tp_group=None,
        vocab_start=0,
        vocab_size=V,
    )


def fused(method: str, hs, ws, mb, heads, norm, projections=None, **settings):  # type: ignore[no-untyped-def]
    """`ensemble_loss`'s loss, values and gradients (`projections`: teachers of another vocabulary)."""
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    transforms = {t: LogitTransform() for t in heads}
    out = ensemble_loss(method, hs, ws, mb, norm, WEIGHTS, heads, transforms, settings, projections)
    out.loss.backward()
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


def reference(method: str, hs, ws, mb, heads, norm, kind: str, temperature: float, projections=None):  # type: ignore[no-untyped-def]
    hs, ws = hs.double().requires_grad_(), ws.double().requires_grad_()
    out = reference_ensemble(
        method,
        hs,
        ws,
        mb.teacher_set,
        {t: h.double() for t, h in mb.teacher_hidden.items()},
        {t: h.double() for t, h in heads.items()},
        {t: float(w) for t, w in enumerate(WEIGHTS)},
        mb.labels,
        norm.double(),
        kind=kind,
        temperature=temperature,
        projections=projections,
    )
    out.loss.backward()
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


@pytest.mark.parametrize(
    ("method", "kind", "chunk", "temperature"),
    list(itertools.product(METHODS, KINDS, [7, 64], [1.0])) + [(m, "reverse_kl", 7, 0.7) for m in METHODS],
)
def test_each_method_equals_the_float64_reference(
    method: str, kind: str, chunk: int, temperature: float
) -> None:
    """Loss, per-token values and both gradients; chunks below and above the token count."""
    hs, ws, mb, heads = case(seed=3)
    norm = torch.rand(N, generator=torch.Generator().manual_seed(4)) / N
    got = fused(method, hs, ws, mb, heads, norm, **options(kind, chunk, temperature))
    want = reference(method, hs, ws, mb, heads, norm, kind, temperature)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, want, strict=True):
        assert_close(g, w, rtol=RTOL, norm=True, what=f"{method} {name}")


def routed(hs, ws, mb, heads, norm, teacher: int, **settings):  # type: ignore[no-untyped-def]
    """Every token routed to `teacher` alone, as a store of one teacher trains."""
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = linear_divergence(
        hs,
        ws,
        {teacher: mb.teacher_hidden[teacher]},
        {teacher: heads[teacher]},
        torch.full((N,), teacher),
        weights=norm * WEIGHTS[teacher],
        teacher_transforms={teacher: LogitTransform()},
        **settings,
    )
    out.loss.backward()
    return out.loss.detach(), out.per_token, hs.grad, ws.grad


def assert_is_routed_run(method: str, hs, ws, mb, heads, *, teacher: int, kind: str) -> None:  # type: ignore[no-untyped-def]
    """`method`'s loss, values and gradients are bit for bit those of every token routed to `teacher`."""
    norm = torch.full((N,), 1.0 / N)
    settings = options(kind, 7, 1.0)
    got = fused(method, hs, ws, mb, heads, norm, **settings)
    alone = routed(hs, ws, mb, heads, norm, teacher, **settings)
    for name, g, w in zip(("loss", "per_token", "grad_hidden", "grad_head"), got, alone, strict=True):
        assert_close(g, w, rtol=0.0, what=name)


@pytest.mark.parametrize("kind", KINDS)
def test_min_ce_where_one_teacher_always_wins_is_that_teachers_run(kind: str) -> None:
    """Teacher 1's states point at each token's label (its probability of it near 1), and where a token
    has no next token it wins the tie as the lower index: min_ce routes every token to it, bit for bit
    the run of a store routed to teacher 1 alone."""
    hs, ws, mb, heads = case(seed=5, sets=[(1, 2)] * N)
    sure = 8 * heads[1][mb.labels.clamp_min(0)]
    mb.teacher_hidden[1] = torch.where((mb.labels >= 0)[:, None], sure, mb.teacher_hidden[1])
    assert_is_routed_run("min_ce", hs, ws, mb, heads, teacher=1, kind=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_sum_with_one_weight_zero_is_the_other_teacher_alone(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hs, ws, mb, heads = case(seed=6, sets=[(0, 1)] * N)
    monkeypatch.setattr(f"{__name__}.WEIGHTS", torch.tensor([0.0, 1.0, 1.0]))
    # Teacher 0's pass adds exact zeros (weight 0) to the loss and both gradients.
    assert_is_routed_run("sum", hs, ws, mb, heads, teacher=1, kind=kind)


def test_confidence_shares_are_each_teachers_normalised_weight() -> None:
    """`confidence` reports, at each token of several teachers, each teacher's w_k · max_v p_k(v) (T = 1)
    over their sum: the weights its mixture used, from float64 logits here."""
    hs, ws, mb, heads = case(seed=7)
    norm = torch.full((N,), 1.0 / N)
    transforms = {t: LogitTransform() for t in heads}
    out = ensemble_loss("confidence", hs, ws, mb, norm, WEIGHTS, heads, transforms, options("jsd", 7, 0.7))
    assert out.shares is not None
    teacher, share = out.shares
    assert mb.teacher_set is not None
    positions = {t: ((mb.teacher_set >> t) & 1).nonzero()[:, 0] for t in mb.teacher_hidden}
    weight = {  # w_k · max_v p_k(v) at each of teacher k's tokens
        t: WEIGHTS[t].double() * (mb.teacher_hidden[t].double() @ heads[t].double().T).softmax(-1).amax(-1)
        for t in positions
    }
    total = torch.zeros(N, dtype=torch.float64)
    for t, pos in positions.items():
        total[pos] += weight[t]
    several = mb.teacher_set & (mb.teacher_set - 1) != 0
    want_teacher = torch.cat([torch.full((int(several[pos].sum()),), t) for t, pos in positions.items()])
    want = torch.cat([(weight[t] / total[pos])[several[pos]] for t, pos in positions.items()])
    assert torch.equal(teacher, want_teacher)
    # Each logit a sum of ≤ 40 products, a log-sum-exp over V = 97, a sum of ≤ 3 weights; the ratio of
    # two such values: fp32 against float64.
    assert_close(share, want, rtol=2 * sum_rtol(40 + 97 + 3), norm=True, what="shares")
