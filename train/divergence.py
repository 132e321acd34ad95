"""Fused, chunked, vocabulary-parallel divergences: student vs teachers rebuilt from hidden states.

Legend: N tokens, C tokens in a chunk, V this tensor-parallel rank's vocabulary slice (V_local),
Hs / Ht student / teacher hidden sizes. `x_NH` is [N, H], `logits_CV` is [C, V], and so on.

Per chunk, both sides' logits come from a GEMM in fp32; the softmax statistics are global over the
tensor-parallel group (all-reduce MAX, then SUM of exp; student and teacher stacked in one collective),
padded vocabulary columns are masked out, and the per-token value and its gradient are formed at once.
Collectives carry O(C) numbers per chunk; nothing of size N × V exists at any time.

Gradients are computed in the forward pass (as Liger's fused linear losses do) and scaled by the
incoming gradient in backward. Chosen by measurement (N=4096, V=49152, H=576, fp32, 2 CPU cores,
chunk 256): a values-only pass takes 7.2 s and values + gradients 7.6 s — the softmax statistics and the
teacher GEMM dominate, the two gradient GEMMs are cheap. Recomputing in backward would pay the
values pass twice (~14.8 s a step) to save one [N, Hs] and one [V, Hs] buffer, memory of the size of
the inputs and parameters that training holds anyway.

Every kind's gradient with respect to the student logits has the form p_s ⊙ (u − ⟨p_s, u⟩), with
u = ∂value/∂p_s (forward KL is written directly as p_s − p_t). Values and gradients are with respect
to the tempered logits z = logits / T; the chain rule's 1/T is applied to the GEMM gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.store.transform import LogitTransform

KINDS = ("reverse_kl", "forward_kl", "jsd", "cross_entropy", "entropy", "tvd")


@dataclass(frozen=True)
class DivergenceOutput:
    loss: torch.Tensor  # scalar, Σ_n weights_n · value_n, differentiable w.r.t. student hidden and head
    per_token: torch.Tensor  # [N] fp32, detached


def _check_inputs(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor | Mapping[int, torch.Tensor],
    teacher_heads: Mapping[int, torch.Tensor],
    teacher_index: torch.Tensor | None,
    kind: str,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Validates the call; returns the per-token teacher index and each teacher's hidden rows."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if not teacher_heads:
        raise ValueError("teacher_heads is empty; give at least one teacher's LM-head shard")
    num_tokens = student_hidden.shape[0]
    heads = dict(teacher_heads)
    first = next(iter(heads.values()))
    for idx, head in heads.items():
        if head.shape[0] != first.shape[0] or head.dtype != first.dtype:
            raise ValueError(
                f"teacher {idx}'s head is [{head.shape[0]}, ·] {head.dtype}, another is "
                f"[{first.shape[0]}, ·] {first.dtype}; every teacher head must have the same local "
                "vocabulary size and dtype"
            )
    if student_head.shape[0] != first.shape[0]:
        raise ValueError(
            f"student head has {student_head.shape[0]} vocabulary rows, teacher heads {first.shape[0]}: "
            "student and teachers must share the vocabulary (and its tensor-parallel split)"
        )
    if student_head.shape[1] != student_hidden.shape[1]:
        raise ValueError(
            f"student hidden size {student_hidden.shape[1]} ≠ student head {student_head.shape[1]}"
        )
    if teacher_index is None:
        if len(heads) != 1:
            raise ValueError(
                f"teacher_index is required when {len(heads)} teacher heads are given ({sorted(heads)}); "
                "mopd never defaults a token to a teacher"
            )
        teacher_index = torch.full((num_tokens,), next(iter(heads)), dtype=torch.long)
    teacher_index = teacher_index.to(device="cpu", dtype=torch.long)
    if teacher_index.shape != (num_tokens,):
        raise ValueError(f"teacher_index has shape {tuple(teacher_index.shape)}, expected ({num_tokens},)")
    present = sorted(set(teacher_index.unique().tolist()))
    absent = [t for t in present if t not in heads]
    if absent:
        raise ValueError(
            f"tokens are routed to teacher {absent[0]}, but no head was given for it (heads: {sorted(heads)})"
        )
    rows: dict[int, torch.Tensor] = {}
    for t in present:
        count = int((teacher_index == t).sum())
        if isinstance(teacher_hidden, Mapping):
            if t not in teacher_hidden:
                raise ValueError(f"teacher {t} has {count} tokens but no hidden states in teacher_hidden")
            rows[t] = teacher_hidden[t]
        else:
            rows[t] = teacher_hidden[(teacher_index == t).to(teacher_hidden.device)]
        if rows[t].shape[0] != count:
            raise ValueError(f"teacher {t}: {rows[t].shape[0]} hidden rows for {count} routed tokens")
        if rows[t].shape[1] != heads[t].shape[1]:
            raise ValueError(f"teacher {t}: hidden size {rows[t].shape[1]} ≠ its head's {heads[t].shape[1]}")
    if not isinstance(teacher_hidden, Mapping) and teacher_hidden.shape[0] != num_tokens:
        raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} rows, student_hidden {num_tokens}")
    return teacher_index, rows


def _all_reduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


_NEEDS_P_T = ("forward_kl", "jsd", "tvd")


def _chunk_value_and_grad(
    buffers: dict[str, torch.Tensor], valid_V: torch.Tensor | None, kind: str, beta: float, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value [C] and d value / d z_s [C, V] from tempered logits, in place.

    `zs` and `zt` hold the tempered logits (masked columns −inf) and become log p_s and log p_t, then
    scratch; `ps` holds p_s. Reverse KL, cross-entropy and entropy need nothing more: 3 buffers of
    [C, V]. Forward KL adds `pt`; JSD and TVD add `work` and a few temporaries. Row sums use torch's
    pairwise reduction (a running dot product loses the 1e-6 agreement of KL = CE − H near values of 5).
    """
    zs, zt, ps = buffers["zs"], buffers["zt"], buffers["ps"]
    stats_max = _all_reduce(torch.stack([zs.amax(1), zt.amax(1)], 1), dist.ReduceOp.MAX, group)
    zs.sub_(stats_max[:, :1])
    zt.sub_(stats_max[:, 1:])
    sum_s = torch.exp(zs, out=ps).sum(1)
    sum_t = torch.exp(zt, out=ps).sum(1)
    sums = _all_reduce(torch.stack([sum_s, sum_t], 1), dist.ReduceOp.SUM, group)
    logp_s = zs.sub_(sums[:, :1].log())
    logp_t = zt.sub_(sums[:, 1:].log())
    p_s = torch.exp(logp_s, out=ps)
    p_t = torch.exp(logp_t, out=buffers["pt"]) if kind in _NEEDS_P_T else None
    if valid_V is not None:  # padded columns: p = 0; make log p finite so that 0 · log p = 0
        logp_s.masked_fill_(~valid_V, 0.0)
        logp_t.masked_fill_(~valid_V, 0.0)

    if kind in ("reverse_kl", "cross_entropy", "entropy"):
        # u = ∂value/∂p_s overwrites one log-prob buffer; the product for the row sum uses the other.
        if kind == "reverse_kl":
            u, spare = torch.sub(logp_s, logp_t, out=logp_t), logp_s
        elif kind == "cross_entropy":
            u, spare = logp_t.neg_(), logp_s
        else:
            u, spare = logp_s.neg_(), logp_t
        value = _all_reduce(torch.mul(p_s, u, out=spare).sum(1), dist.ReduceOp.SUM, group)
        return value, u.sub_(value[:, None]).mul_(p_s)
    assert p_t is not None
    if kind == "forward_kl":
        value = _all_reduce(logp_t.sub_(logp_s).mul_(p_t).sum(1), dist.ReduceOp.SUM, group)
        return value, torch.sub(p_s, p_t, out=logp_s)
    work = buffers["work"]
    if kind == "jsd" and beta in (0.0, 1.0):  # m equals one side: both terms vanish
        return torch.zeros_like(stats_max[:, 0]), work.zero_()
    if kind == "jsd":
        logm = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log(1 - beta))
        terms = beta * p_t * (logp_t - logm) + (1 - beta) * p_s * (logp_s - logm)
        u = torch.sub(logp_s, logm, out=work).mul_(1 - beta)
    else:  # tvd; sign(0) = 0, the subgradient autograd takes for |x| at 0
        terms = 0.5 * (p_s - p_t).abs()
        u = torch.sub(p_s, p_t, out=work).sign_().mul_(0.5)
    reduced = _all_reduce(torch.stack([terms.sum(1), (p_s * u).sum(1)], 1), dist.ReduceOp.SUM, group)
    return reduced[:, 0], u.sub_(reduced[:, 1:]).mul_(p_s)


def _finish(
    ctx: Any,
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    grad_hs_NH: torch.Tensor | None,
    grad_ws_VH: torch.Tensor | None,
    weights_N: torch.Tensor,
    values_N: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """End of a forward that formed its gradients: keep them for backward; return (loss, values)."""
    # Each rank holds the part of d loss / d h from its vocabulary slice; the full gradient is the
    # sum, as a column-parallel output layer's backward would produce. O(N · Hs) bytes, once.
    if grad_hs_NH is not None:
        _all_reduce(grad_hs_NH, dist.ReduceOp.SUM, group)
    ctx.save_for_backward(
        grad_hs_NH.to(student_hidden.dtype) if grad_hs_NH is not None else None,
        grad_ws_VH.to(student_head.dtype) if grad_ws_VH is not None else None,
    )
    ctx.mark_non_differentiable(values_N)
    return (weights_N * values_N).sum(), values_N


def _backward(ctx: Any, grad_loss: torch.Tensor, _grad_values: torch.Tensor) -> tuple[Any, ...]:
    """The gradients formed in forward, scaled by the incoming gradient of the loss."""
    grad_hs, grad_ws = ctx.saved_tensors
    scale = lambda g: None if g is None else g * grad_loss  # noqa: E731
    return scale(grad_hs), scale(grad_ws), None


def _valid_columns(
    vocab_start: int, local_vocab: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[V_local] mask of real vocabulary columns, or None when this slice has no padding."""
    if vocab_start + local_vocab <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, device=device) < vocab_size


class _FusedLinearDivergence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        student_hidden: torch.Tensor,
        student_head: torch.Tensor,
        plan: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hs_NH = student_hidden.detach().float()
        ws_VH = student_head.detach().float()
        order, rows, heads, transforms = plan["order"], plan["rows"], plan["heads"], plan["transforms"]
        index_sorted, weights_N, temperature = plan["index_sorted"], plan["weights"], plan["temperature"]
        valid_V, group, chunk = plan["valid"], plan["group"], plan["chunk_size"]
        num_tokens = hs_NH.shape[0]
        # Only the gradients autograd will ask for are formed (none under torch.no_grad: evaluation).
        grad_hs_NH = torch.zeros_like(hs_NH) if ctx.needs_input_grad[0] else None
        grad_ws_VH = torch.zeros_like(ws_VH) if ctx.needs_input_grad[1] else None
        values_N = torch.zeros(num_tokens, dtype=torch.float32, device=hs_NH.device)
        # Each teacher's rows are consumed in token order; `cursor` is the next unread row per teacher.
        cursor = dict.fromkeys(rows, 0)
        width = min(chunk, num_tokens)
        names = ["zs", "zt", "ps"] + (["pt"] if plan["kind"] in _NEEDS_P_T else [])
        names += ["work"] if plan["kind"] in ("jsd", "tvd") else []
        full = {name: hs_NH.new_empty(width, ws_VH.shape[0]) for name in names}
        for start in range(0, num_tokens, chunk):
            tokens_C = order[start : start + chunk]
            teachers_C = index_sorted[start : start + chunk]
            size = tokens_C.shape[0]
            buffers = {name: buf[:size] for name, buf in full.items()}
            hs_CH = hs_NH[tokens_C]
            torch.mm(hs_CH, ws_VH.T, out=buffers["zs"]).div_(temperature)
            # Tokens are sorted by teacher, so each teacher's tokens form one run of the chunk: one GEMM
            # per teacher present, written straight into its rows of the teacher logits.
            teachers, counts = torch.unique_consecutive(teachers_C, return_counts=True)
            row = 0
            for t, count in zip(teachers.tolist(), counts.tolist(), strict=True):
                first = cursor[t]
                cursor[t] += count
                block = buffers["zt"][row : row + count]
                torch.mm(rows[t][first : cursor[t]], heads[t].T, out=block)
                transforms[t].apply_(block).div_(temperature)
                row += count
            if valid_V is not None:
                buffers["zs"].masked_fill_(~valid_V, float("-inf"))
                buffers["zt"].masked_fill_(~valid_V, float("-inf"))
            value_C, grad_CV = _chunk_value_and_grad(buffers, valid_V, plan["kind"], plan["beta"], group)
            values_N[tokens_C] = value_C
            if grad_hs_NH is None and grad_ws_VH is None:
                continue
            grad_CV.mul_((weights_N[tokens_C] / temperature)[:, None])
            if grad_hs_NH is not None:
                grad_hs_NH[tokens_C] = grad_CV @ ws_VH
            if grad_ws_VH is not None:
                grad_ws_VH.addmm_(grad_CV.T, hs_CH)
        return _finish(ctx, student_hidden, student_head, grad_hs_NH, grad_ws_VH, weights_N, values_N, group)

    backward = staticmethod(_backward)


def linear_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor | Mapping[int, torch.Tensor],
    teacher_heads: Mapping[int, torch.Tensor],
    teacher_index: torch.Tensor | None,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weights: torch.Tensor | None = None,
    chunk_size: int = 1024,
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_student,n ‖ p_teacher,n) without materialising any [N, V] tensor.

    Args:
        student_hidden: [N, Hs] final hidden states of the student (requires grad).
        student_head: [V_local, Hs] this rank's shard of the student's output layer.
        teacher_hidden: [N, Ht] when all teachers share Ht, or {teacher: [N_t, H_t]} holding teacher t's
            tokens (those with teacher_index == t) in token order.
        teacher_heads: {teacher: [V_local, H_t]} this rank's shard of each teacher's LM head; all of one
            V_local and dtype.
        teacher_index: [N] teacher of each token, or None when exactly one head is given.
        kind: reverse_kl, forward_kl, jsd (with `beta`), cross_entropy, entropy or tvd.
        temperature: divides both sides' logits (after the teacher's transform).
        weights: [N] loss mask × normaliser; default 1/N.
        chunk_size: tokens per chunk; peak extra memory is O(chunk_size × V_local + N × Hs).
        tp_group: tensor-parallel process group over which the vocabulary is split (None: not split).
        vocab_start: first global vocabulary id of this rank's slice.
        vocab_size: global vocabulary size; columns at or past it are padding and excluded.
        teacher_transforms: {teacher: LogitTransform} logit scale / softcap per teacher.

    Returns:
        DivergenceOutput(loss with gradients to student_hidden and student_head, per_token values [N]).

    Raises:
        ValueError: unknown kind; heads of different V_local or dtype; a token routed to a teacher with
            no head; a missing teacher_index with several heads; an index or hidden row count that does
            not match the tokens.
    """
    teacher_index, rows = _check_inputs(
        student_hidden, student_head, teacher_hidden, teacher_heads, teacher_index, kind
    )
    if chunk_size <= 0 or temperature <= 0:
        raise ValueError(f"chunk_size and temperature must be positive, got {chunk_size}, {temperature}")
    device = student_hidden.device
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    valid = _valid_columns(vocab_start, local_vocab, vocab_size, device)
    order = torch.argsort(teacher_index, stable=True).to(device)  # group tokens by teacher
    transforms = {t: (teacher_transforms or {}).get(t, LogitTransform()) for t in rows}
    weights = (
        torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=device) if weights is None else weights
    )
    if weights.shape != (num_tokens,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected ({num_tokens},)")
    plan = {
        "order": order,
        "index_sorted": teacher_index.to(device)[order],
        "rows": {t: r.detach().float() for t, r in rows.items()},
        "heads": {t: teacher_heads[t].detach().float() for t in rows},
        "transforms": transforms,
        "weights": weights.detach().float(),
        "temperature": float(temperature),
        "valid": valid,
        "group": tp_group,
        "chunk_size": int(chunk_size),
        "kind": kind,
        "beta": float(beta),
    }
    loss, per_token = _FusedLinearDivergence.apply(student_hidden, student_head, plan)
    return DivergenceOutput(loss=loss, per_token=per_token)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """−log p_s(label) per token, chunked and vocabulary-parallel like the divergences; grads in forward."""

    @staticmethod
    def forward(
        ctx: Any, student_hidden: torch.Tensor, student_head: torch.Tensor, plan: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hs_NH, ws_VH = student_hidden.detach().float(), student_head.detach().float()
        labels_N, weights_N, valid_V, group = plan["labels"], plan["weights"], plan["valid"], plan["group"]
        chunk, vocab_start, temperature = plan["chunk_size"], plan["vocab_start"], plan["temperature"]
        num_tokens, local_vocab = hs_NH.shape[0], ws_VH.shape[0]
        grad_hs_NH = torch.zeros_like(hs_NH) if ctx.needs_input_grad[0] else None
        grad_ws_VH = torch.zeros_like(ws_VH) if ctx.needs_input_grad[1] else None
        values_N = torch.zeros(num_tokens, dtype=torch.float32, device=hs_NH.device)
        logits_full = hs_NH.new_empty(min(chunk, num_tokens), local_vocab)
        for start in range(0, num_tokens, chunk):
            stop = min(start + chunk, num_tokens)
            logits_CV = torch.mm(hs_NH[start:stop], ws_VH.T, out=logits_full[: stop - start]).div_(
                temperature
            )
            if valid_V is not None:
                logits_CV.masked_fill_(~valid_V, float("-inf"))
            local_C = labels_N[start:stop] - vocab_start
            mine_C = (local_C >= 0) & (local_C < local_vocab)
            at_C = torch.where(mine_C, local_C, 0)
            label_logit_C = torch.where(mine_C, logits_CV.gather(1, at_C[:, None])[:, 0], 0.0)
            max_C = _all_reduce(logits_CV.amax(1), dist.ReduceOp.MAX, group)
            probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
            sums = _all_reduce(torch.stack([probs_CV.sum(1), label_logit_C], 1), dist.ReduceOp.SUM, group)
            values_N[start:stop] = max_C + sums[:, 0].log() - sums[:, 1]
            if grad_hs_NH is None and grad_ws_VH is None:
                continue
            grad_CV = probs_CV.div_(sums[:, :1])  # softmax − one-hot(label), on the label's owner rank
            rows_C = torch.arange(stop - start, device=grad_CV.device)
            grad_CV[rows_C[mine_C], at_C[mine_C]] -= 1.0
            grad_CV.mul_((weights_N[start:stop] / temperature)[:, None])
            if grad_hs_NH is not None:
                grad_hs_NH[start:stop] = grad_CV @ ws_VH
            if grad_ws_VH is not None:
                grad_ws_VH.addmm_(grad_CV.T, hs_NH[start:stop])
        return _finish(ctx, student_hidden, student_head, grad_hs_NH, grad_ws_VH, weights_N, values_N, group)

    backward = staticmethod(_backward)


def linear_cross_entropy(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    labels: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> DivergenceOutput:
    """Σ_n weights_n · (−log p_s(labels_n)), the hard-label loss, without any [N, V] tensor.

    Args:
        student_hidden: [N, Hs]; student_head: [V_local, Hs] this rank's shard.
        labels: [N] global vocabulary ids; a negative label (e.g. −100) contributes zero.
        weights, temperature, chunk_size, tp_group, vocab_start, vocab_size: as `linear_divergence`.
    """
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    if labels.shape != (num_tokens,):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected ({num_tokens},)")
    device = student_hidden.device
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    if labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"a label is ≥ the vocabulary size {vocab_size}")
    valid = _valid_columns(vocab_start, local_vocab, vocab_size, device)
    weights = (
        torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=device) if weights is None else weights
    )
    labels = labels.to(device)
    plan = {
        "labels": torch.where(labels < 0, -(10**12), labels),  # owned by no rank
        "weights": torch.where(labels < 0, 0.0, weights.detach().float()),
        "valid": valid,
        "group": tp_group,
        "chunk_size": int(chunk_size),
        "vocab_start": int(vocab_start),
        "temperature": float(temperature),
    }
    loss, per_token = _FusedLinearCrossEntropy.apply(student_hidden, student_head, plan)
    return DivergenceOutput(loss=loss, per_token=torch.where(labels < 0, 0.0, per_token))
