"""Acceptance: vocabulary-parallel divergences on real gloo groups equal the single-process result."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from mopd.train.kernel.divergence import linear_divergence
from mopd.train.kernel.ensemble import mixture_divergence
from mopd.train.kernel.labels import linear_cross_entropy
from mopd.train.kernel.reference import reference_divergence
from tests.distributed.harness import run_distributed
from tests.tolerance import assert_close, perturbed, sum_rtol, value_atol
from tests.train.divergence_cases import Case, logit_range, make_case

pytestmark = pytest.mark.distributed
VOCAB = 1000


def shard(head: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """Rank's slice of a [V, H] head, zero-padded to ceil(V / world) rows, and its first vocab id."""
    local = -(-head.shape[0] // world)
    start = rank * local
    part = head[start : start + local]
    pad = torch.zeros(local - part.shape[0], head.shape[1], dtype=head.dtype)
    return torch.cat([part, pad]), start


def run_case(
    case: Case, kind: str, *, rank: int = 0, world: int = 1, chunk_size: int = 6
) -> dict[str, torch.Tensor]:
    hs = case.student_hidden.detach().clone().requires_grad_()
    ws_local, start = shard(case.student_head.detach(), rank, world)
    ws_local.requires_grad_()
    heads = {t: shard(h, rank, world)[0] for t, h in case.teacher_heads.items()}
    out = linear_divergence(
        hs,
        ws_local,
        case.teacher_hidden,
        heads,
        case.teacher_index,
        kind=kind,
        temperature=0.7,
        weights=case.weights,
        chunk_size=chunk_size,
        teacher_transforms=case.transforms,
        tp_group=dist.group.WORLD if world > 1 else None,
        vocab_start=start,
        vocab_size=VOCAB,
    )
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "per_token": out.per_token,
        "grad_hidden": hs.grad,
        "grad_head": ws_local.grad[: max(0, min(ws_local.shape[0], VOCAB - start))],
    }


def _worker(rank: int, world: int, kinds: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    case = make_case(teachers=3, softcap=True, vocab=VOCAB, num_tokens=19, seed=11)
    return {kind: run_case(case, kind, rank=rank, world=world) for kind in kinds}


def assert_tp_parity(got: torch.Tensor, want: torch.Tensor, what: str, *, case: Case) -> None:
    """A tensor-parallel split sums the vocabulary's terms in another order (partial sums per rank,
    then an all-reduce). Values and losses: one token's rounding, `value_atol` over the V = 1000 columns
    (a loss is a convex combination of values). Gradients: a sum over the vocabulary of terms that are
    themselves dot products (≤ 40 terms) and, for the head, over the N = 19 tokens, in any order: the
    worst case of 40 + 1000 + 19 roundings per side, relative to the largest entry."""
    if what.split()[-1] in ("loss", "per_token"):
        assert_close(got, want, atol=value_atol(VOCAB, logit_range(case, 0.7)), what=what)
    else:
        assert_close(got, want, rtol=2 * sum_rtol(40 + VOCAB + 19), norm=True, what=what)


KINDS_TP = ["reverse_kl", "forward_kl", "jsd", "cross_entropy", "entropy", "tvd"]


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_equals_single_process(world: int) -> None:
    results = run_distributed(_worker, world_size=world, args=(KINDS_TP,), timeout=120)
    case = make_case(teachers=3, softcap=True, vocab=VOCAB, num_tokens=19, seed=11)
    for kind in KINDS_TP:
        dense = run_case(case, kind, chunk_size=5 if perturbed() else 6)
        for rank in range(world):
            got = results[rank][kind]
            for name in ("loss", "per_token", "grad_hidden"):  # the same on every rank
                assert_tp_parity(got[name], dense[name], f"{kind} rank {rank} {name}", case=case)
        head = torch.cat([results[r][kind]["grad_head"] for r in range(world)])
        assert head.shape == dense["grad_head"].shape
        assert_tp_parity(head, dense["grad_head"], f"{kind} grad_head", case=case)


def run_hard_ce(
    case: Case, labels: torch.Tensor, *, rank: int = 0, world: int = 1
) -> dict[str, torch.Tensor]:
    hs = case.student_hidden.detach().clone().requires_grad_()
    ws_local, start = shard(case.student_head.detach(), rank, world)
    ws_local.requires_grad_()
    out = linear_cross_entropy(
        hs,
        ws_local,
        labels,
        weights=case.weights,
        temperature=0.7,
        chunk_size=6,
        tp_group=dist.group.WORLD if world > 1 else None,
        vocab_start=start,
        vocab_size=VOCAB,
    )
    out.loss.backward()
    return {"loss": out.loss.detach(), "per_token": out.per_token, "grad_hidden": hs.grad}


def _ce_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    case = make_case(teachers=1, vocab=VOCAB, num_tokens=19, seed=12)
    return run_hard_ce(case, _labels(), rank=rank, world=world)


def _labels() -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(5))
    labels[[0, 7]] = torch.tensor([-100, VOCAB - 1])  # an ignored position; the last id (on the last rank)
    return labels


def test_tensor_parallel_hard_label_ce_equals_torch() -> None:
    results = run_distributed(_ce_worker, world_size=2, timeout=120)
    case = make_case(teachers=1, vocab=VOCAB, num_tokens=19, seed=12)
    hs = case.student_hidden.detach().double().requires_grad_()
    logits = hs @ case.student_head.detach().double().T / 0.7
    per_token = torch.nn.functional.cross_entropy(logits, _labels(), ignore_index=-100, reduction="none")
    loss = (case.weights.double() * per_token).sum()
    loss.backward()
    for rank in range(2):
        assert_tp_parity(results[rank]["per_token"], per_token, f"rank {rank} per_token", case=case)
        assert_tp_parity(results[rank]["loss"], loss, f"rank {rank} loss", case=case)
        assert_tp_parity(results[rank]["grad_hidden"], hs.grad, f"rank {rank} grad_hidden", case=case)
    assert results[0]["per_token"][0] == 0.0


# A tokenizer of 259 tokens; teachers' output layers padded to 320 and 384 rows, the student's to 288
# (Qwen2.5-7B → 1.5B in miniature). Padding rows hold large noise: any that leaked into a softmax would
# dominate it.
TOKENS, TEACHER_ROWS, STUDENT_ROWS = 259, (320, 384), 288


def padded_case() -> Case:
    case = make_case(teachers=2, vocab=TOKENS, num_tokens=19, seed=13)
    g = torch.Generator().manual_seed(14)

    def pad(head: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([head, 8.0 * torch.randn(rows - head.shape[0], head.shape[1], generator=g)])

    case.teacher_heads = {t: pad(h, TEACHER_ROWS[t]) for t, h in case.teacher_heads.items()}
    case.student_head = pad(case.student_head.detach(), STUDENT_ROWS).requires_grad_()
    return case


def shard_bounds(vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of `tp_rank`'s slice of a vocabulary padded up to a multiple of `tp_size`: equal
    slices, the last one's tail past `vocab` masked by the kernel (`linear_divergence(vocab_size=…)`)."""
    local = -(-vocab // tp_size)
    return tp_rank * local, (tp_rank + 1) * local


def run_padded(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of the 259 real tokens (padded up to a multiple of `world`), cut from every
    head whatever its own padding: columns past 259 are masked by `vocab_size`."""
    case = padded_case()
    start, stop = shard_bounds(TOKENS, rank, world)
    hs = case.student_hidden.detach().clone().requires_grad_()
    ws = case.student_head.detach()[start:stop].clone().requires_grad_()
    out = linear_divergence(
        hs,
        ws,
        case.teacher_hidden,
        {t: h[start:stop] for t, h in case.teacher_heads.items()},
        case.teacher_index,
        kind="reverse_kl",
        weights=case.weights,
        chunk_size=6,
        tp_group=dist.group.WORLD if world > 1 else None,
        vocab_start=start,
        vocab_size=TOKENS,
    )
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "per_token": out.per_token,
        "grad_hidden": hs.grad,
        "grad_head": ws.grad,
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_padded_vocabularies_equal_the_reference_over_the_real_tokens(world: int) -> None:
    """Losses, per-token values and gradients at TP = 1, 2 and 3 (uneven: 259 = 3 × 87 − 2) equal an
    fp64 reference over the first 259 rows of each head; the padding rows get no gradient."""
    results = run_distributed(run_padded, world_size=world, timeout=120) if world > 1 else [run_padded(0, 1)]
    case = padded_case()
    reference = Case(
        case.student_hidden.detach().clone().requires_grad_(),
        case.student_head.detach()[:TOKENS].clone().requires_grad_(),
        case.teacher_hidden,
        {t: h[:TOKENS] for t, h in case.teacher_heads.items()},
        case.teacher_index,
        case.weights,
    ).to(torch.float64)
    want = reference_divergence(
        reference.student_hidden,
        reference.student_head,
        reference.teacher_hidden,
        reference.teacher_heads,
        reference.teacher_index,
        weights=reference.weights,
    )
    want.loss.backward()
    for rank, got in enumerate(results):
        assert_tp_parity(got["loss"], want.loss, f"rank {rank} loss", case=reference)
        assert_tp_parity(got["per_token"], want.per_token, f"rank {rank} per_token", case=reference)
        assert_tp_parity(
            got["grad_hidden"], reference.student_hidden.grad, f"rank {rank} grad_hidden", case=reference
        )
    head = torch.cat([r["grad_head"] for r in results])
    assert_tp_parity(head[:TOKENS], reference.student_head.grad, "grad_head", case=reference)
    assert torch.equal(head[TOKENS:], torch.zeros_like(head[TOKENS:]))  # past the tokens: no gradient


def run_projected(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """A teacher of another vocabulary (tests/train/test_projected_divergence.cross_case) with the
    student's 41 tokens split over `world` ranks (the last slice padded): each rank projects the whole
    teacher distribution onto its slice."""
    from mopd.train.kernel.projected import projected_divergence
    from tests.train.test_projected_divergence import TEMPERATURE, cross_case

    case = cross_case()
    out = {}
    for kind in KINDS_TP:
        hs = case.student_hidden.clone().requires_grad_()
        ws, start = shard(case.student_head, rank, world)
        ws.requires_grad_()
        result = projected_divergence(
            hs,
            ws,
            case.teacher_hidden,
            case.teacher_head,
            case.projection,
            kind=kind,
            temperature=TEMPERATURE,
            weights=case.weights,
            chunk_size=5,
            tp_group=dist.group.WORLD if world > 1 else None,
            vocab_start=start,
            vocab_size=case.projection.student_vocab,
            teacher_transform=case.transform,
        )
        result.loss.backward()
        assert ws.grad is not None
        real = max(0, min(ws.shape[0], case.projection.student_vocab - start))
        out[kind] = {
            "loss": result.loss.detach(),
            "per_token": result.per_token,
            "grad_hidden": hs.grad,
            "grad_head": ws.grad[:real],
        }
    return out


def test_projected_teacher_under_tensor_parallelism_equals_single_process() -> None:
    """TP = 2 over gloo against TP = 1, every kind: the values within `value_bound` (the same fp32
    computation with the student's softmax statistics summed in another order), the gradients within
    the sums of ≤ Vs + N terms taken in another order (as `assert_tp_parity`)."""
    from tests.train.test_projected_divergence import cross_case, value_bound

    results = run_distributed(run_projected, world_size=2, timeout=120)
    dense = run_projected(0, 1)
    case = cross_case()
    terms = case.projection.student_vocab + case.student_hidden.shape[0]
    for kind in KINDS_TP:
        for rank in range(2):
            for name in ("loss", "per_token"):
                assert_close(
                    results[rank][kind][name],
                    dense[kind][name],
                    atol=value_bound(case),
                    what=f"{kind} {name}",
                )
            got = results[rank][kind]["grad_hidden"]
            assert_close(
                got,
                dense[kind]["grad_hidden"],
                rtol=2 * sum_rtol(terms),
                norm=True,
                what=f"{kind} grad_hidden",
            )
        head = torch.cat([results[r][kind]["grad_head"] for r in range(2)])
        assert_close(
            head, dense[kind]["grad_head"], rtol=2 * sum_rtol(terms), norm=True, what=f"{kind} grad_head"
        )


def _mixture_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    from tests.train.test_ensemble import N, V, ensemble_case

    hs, ws, members, heads = ensemble_case(seed=13)
    ws_local, start = shard(ws, rank, world)
    out = {}
    for kind in KINDS_TP:
        h, w = hs.clone().requires_grad_(), ws_local.clone().requires_grad_()
        result = mixture_divergence(
            h,
            w,
            members,
            {t: shard(head, rank, world)[0] for t, head in heads.items()},
            kind=kind,
            temperature=0.7,
            weights=torch.full((N,), 1.0 / N),
            chunk_size=6,
            tp_group=dist.group.WORLD,
            vocab_start=start,
            vocab_size=V,
        )
        result.loss.backward()
        assert h.grad is not None and w.grad is not None
        rows = max(0, min(w.shape[0], V - start))
        out[kind] = {"per_token": result.per_token, "grad_hidden": h.grad, "grad_head": w.grad[:rows]}
    return out


def test_a_mixture_under_tensor_parallelism_equals_the_float64_reference() -> None:
    """Each token's mixture of up to 3 teachers, the vocabulary (97, padded to 2 × 49) split over 2 gloo
    ranks, every kind: values and gradients against the float64 reference within the bound of
    tests/train/test_ensemble.py (worst-case sums: the split only reorders their terms)."""
    from tests.train.test_ensemble import RTOL, N, ensemble_case, reference

    results = run_distributed(_mixture_worker, world_size=2, timeout=120)
    hs, ws, members, heads = ensemble_case(seed=13)
    for kind in KINDS_TP:
        _loss, per_token, grad_hidden, grad_head = reference(
            hs, ws, members, heads, kind=kind, temperature=0.7, weights=torch.full((N,), 1.0 / N)
        )
        for rank in range(2):
            got = results[rank][kind]
            assert_close(got["per_token"], per_token, rtol=RTOL, norm=True, what=f"{kind} per_token")
            assert_close(got["grad_hidden"], grad_hidden, rtol=RTOL, norm=True, what=f"{kind} grad_hidden")
        head = torch.cat([results[r][kind]["grad_head"] for r in range(2)])
        assert_close(head, grad_head, rtol=RTOL, norm=True, what=f"{kind} grad_head")


def _methods_worker(rank: int, world: int, cross: bool) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    from mopd.store.format.transform import LogitTransform
    from mopd.train.ensembles import METHODS, ensemble_loss
    from tests.train.test_teacher_sets import WEIGHTS, N, V, case
    from tests.train.test_teacher_sets_cross import cross_case

    hs, ws, mb, heads, projections = cross_case(seed=13) if cross else (*case(seed=13), {})
    ws_local, start = shard(ws, rank, world)
    # A teacher of another vocabulary keeps its head whole on every rank (projected onto each slice).
    local_heads = {t: head if t in projections else shard(head, rank, world)[0] for t, head in heads.items()}
    norm = torch.full((N,), 1.0 / N)
    out = {}
    for method, kind in itertools.product(METHODS, KINDS_TP):
        h, w = hs.clone().requires_grad_(), ws_local.clone().requires_grad_()
        settings = dict(kind=kind, beta=0.5, temperature=0.7, chunk_size=6, compiled=False)
        settings |= dict(tp_group=dist.group.WORLD, vocab_start=start, vocab_size=V)
        transforms = {t: LogitTransform() for t in heads}
        result = ensemble_loss(
            method, h, w, mb, norm, WEIGHTS, local_heads, transforms, settings, projections
        )
        result.loss.backward()
        assert h.grad is not None and w.grad is not None
        rows = max(0, min(w.shape[0], V - start))
        out[method, kind] = {"per_token": result.per_token, "grad_hidden": h.grad, "grad_head": w.grad[:rows]}
    return out


@pytest.mark.parametrize("cross", [False, True], ids=["one vocabulary", "a teacher of another"])
def test_each_ensemble_method_under_tensor_parallelism_equals_the_float64_reference(cross: bool) -> None:
    """`mixture`, `sum`, `min_ce` and `confidence` (teachers' next-token and top-token probabilities
    reduced over the group), the vocabulary (97, padded to 2 × 49) split over 2 gloo ranks, every kind,
    with and without a teacher of another vocabulary (its projection onto each rank's slice; the columns
    a token's target reaches none of leave it on each rank): values and gradients against the float64
    reference within tests/train/test_teacher_sets*.py's bounds (the split only reorders the sums' terms)."""
    from tests.train import test_teacher_sets as same
    from tests.train import test_teacher_sets_cross as other

    results = run_distributed(_methods_worker, world_size=2, args=(cross,), timeout=120)
    norm = torch.full((same.N,), 1.0 / same.N)
    hs, ws, mb, heads, projections = other.cross_case(seed=13) if cross else (*same.case(seed=13), {})
    rtol = other.RTOL if cross else same.RTOL
    for (method, kind), got_rank0 in results[0].items():
        want = same.reference(method, hs, ws, mb, heads, norm, kind, 0.7, projections)
        _, per_token, grad_hidden, grad_head = want
        for got in (got_rank0, results[1][method, kind]):
            assert_close(got["per_token"], per_token, rtol=rtol, norm=True, what=f"{method} {kind} per_token")
            assert_close(
                got["grad_hidden"], grad_hidden, rtol=rtol, norm=True, what=f"{method} {kind} grad_hidden"
            )
        head = torch.cat([results[r][method, kind]["grad_head"] for r in range(2)])
        assert_close(head, grad_head, rtol=rtol, norm=True, what=f"{method} {kind} grad_head")
