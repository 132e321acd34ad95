"""Fused, chunked, vocabulary-parallel divergences: student vs teachers rebuilt from hidden states, nothing
of size tokens × vocabulary ever formed (the design notes: docs/internals.md, train/kernel/divergence.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from mopd.config.train import DivergenceKind
from mopd.store.format.transform import LogitTransform
from mopd.train.kernel.chunk_chain import (
    NEEDS_P_T,
    all_reduce,
    block_rows,
    cached_compile,
    chunk_size_for,
    shape_key,
    soft_in_blocks,
    soft_value_and_grad,
)
from mopd.train.kernel.gemm import mm, mm_add, native_gemms, operand, split_gradient

KINDS: tuple[str, ...] = get_args(DivergenceKind)


@dataclass(frozen=True)
class DivergenceOutput:
    loss: torch.Tensor  # scalar, Σ_n weights_n · value_n, differentiable w.r.t. student hidden and head
    per_token: torch.Tensor  # [N] fp32, detached
    # A sum over several teachers (`ensemble.mixture_divergence(combine="sum")`): each teacher's own
    # value at the tokens it scores, in their order.
    by_teacher: dict[int, torch.Tensor] | None = None


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
    return teacher_index, _teacher_rows(teacher_hidden, teacher_index, heads, present)


def _teacher_rows(
    teacher_hidden: torch.Tensor | Mapping[int, torch.Tensor],
    teacher_index: torch.Tensor,
    heads: Mapping[int, torch.Tensor],
    present: list[int],
) -> dict[int, torch.Tensor]:
    """Each present teacher's hidden rows, checked against its routed tokens and its head."""
    num_tokens = teacher_index.shape[0]
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
    return rows


def valid_columns(
    vocab_start: int, local_vocab: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[V_local] mask of real vocabulary columns, or None when this slice has no padding."""
    if vocab_start + local_vocab <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, device=device) < vocab_size


@dataclass(frozen=True)
class _Plan:
    """Everything one call's chunk loop needs, fixed before it starts.

    `order` lists token positions in the order the chunks take them: grouped by teacher for the
    divergences (so that each teacher's tokens form one run), None for token order.
    """

    objective: _ChunkObjective
    order: torch.Tensor | None
    weights: torch.Tensor  # [N] fp32, indexed by token position
    temperature: float
    chunk_size: int
    valid: torch.Tensor | None
    group: Any
    native: bool
    compiled: bool = False  # run the chunk chain compiled (single-rank only: see `_SoftTargets`)
    # Where each chunk starts (None: every chunk_size tokens), for an objective whose chunks must hold
    # whole groups of tokens (`spans.span_likelihood_match`); a chunk may then pass chunk_size.
    starts: tuple[int, ...] | None = None


class _ChunkObjective:
    """One loss's part of the chunk loop: given the student's tempered logits of a chunk (`zs`, padded
    columns −inf), the per-token value [C] and d value / d zs [C, V] (in place of the buffers)."""

    buffer_names: tuple[str, ...] = ("zs",)

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`full` holds the chunk-wide buffers; this chunk's rows are the first `span` length. The
        gradient comes multiplied by `scale_C` (each token's weight over the temperature)."""
        raise NotImplementedError

    def prepare(self, full: dict[str, torch.Tensor], plan: _Plan) -> None:
        """Called once with the chunk-wide buffers before the first chunk."""


class _SoftTargets(_ChunkObjective):
    """A divergence from the teachers' distributions, each rebuilt from its hidden rows and head."""

    def __init__(
        self,
        kind: str,
        beta: float,
        teacher_index: torch.Tensor,
        rows: Mapping[int, torch.Tensor],
        heads: Mapping[int, torch.Tensor],
        transforms: Mapping[int, LogitTransform],
    ) -> None:
        self.kind, self.beta = kind, beta
        self.teacher_index = teacher_index  # [N] teacher of each position of `order`
        self.rows, self.heads, self.transforms = rows, heads, transforms
        names = ["zs", "zt", "ps"] + (["pt"] if kind in NEEDS_P_T else [])
        self.buffer_names = tuple(names + (["work"] if kind in ("jsd", "tvd") else []))
        # Each teacher's rows are consumed in order; `cursor` is the next unread row of each. Its head
        # as a GEMM operand lives while its tokens are in flight: one teacher's at a time.
        self.cursor = dict.fromkeys(rows, 0)
        self.operand: tuple[int, torch.Tensor] | None = None
        self.chain: Any = None  # the compiled chunk chain, when used
        self.block: int | None = None  # rows at a time of the eager chain, where it runs in blocks

    def _head(self, teacher: int, native: bool) -> torch.Tensor:
        if self.operand is None or self.operand[0] != teacher:
            self.operand = None  # let the previous teacher's copy go before making the next one
            self.operand = (teacher, operand(self.heads[teacher], native))
        return self.operand[1]

    def teacher_logits(
        self, hidden_CH: torch.Tensor, teacher: int, out_CV: torch.Tensor, plan: _Plan
    ) -> None:
        """Teacher `teacher`'s tempered logits of a run of the chunk's tokens into `out_CV`."""
        mm(hidden_CH, self._head(teacher, plan.native).T, out=out_CV)
        _temper(self.transforms[teacher].apply_(out_CV), plan.temperature)

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        buffers = {name: buf[:size] for name, buf in full.items()}
        # Tokens are sorted by teacher, so each teacher's tokens form one run of the chunk: one GEMM
        # per teacher present, written straight into its rows of the teacher logits.
        teachers, counts = torch.unique_consecutive(self.teacher_index[span], return_counts=True)
        row = 0
        for t, count in zip(teachers.tolist(), counts.tolist(), strict=True):
            first = self.cursor[t]
            self.cursor[t] += count
            hidden = operand(self.rows[t][first : self.cursor[t]], plan.native)
            self.teacher_logits(hidden, t, buffers["zt"][row : row + count], plan)
            row += count
            if self.cursor[t] == self.rows[t].shape[0]:
                self.operand = None  # this teacher's tokens are done
        if plan.valid is not None:
            buffers["zt"].masked_fill_(~plan.valid, float("-inf"))
        chain = self.chain
        if chain is None and self.block is not None:
            return soft_in_blocks(buffers, self.block, plan.valid, self.kind, self.beta, scale_C)
        if chain is None:
            return soft_value_and_grad(buffers, plan.valid, self.kind, self.beta, scale_C, plan.group)
        # One shape, one compilation: the last, shorter chunk runs full width too (its spare rows hold
        # an earlier chunk's finite logits, scaled by 0) and its own rows are taken from the result.
        value, grad = chain(full, plan.valid, self.kind, self.beta, _full_width(scale_C, full), None)
        return value[:size], grad[:size]

    def prepare(self, full: dict[str, torch.Tensor], plan: _Plan) -> None:
        # Compiled only without tensor parallelism: the chain's collectives stay eager elsewhere.
        use = plan.compiled and plan.group is None
        scale = full["zs"].new_zeros(full["zs"].shape[0])
        args = (full, plan.valid, self.kind, self.beta, scale, None)
        key = (self.kind, self.beta, *shape_key(full["zs"]), plan.valid is not None)
        self.chain = cached_compile(soft_value_and_grad, key, list(full.values()), *args) if use else None
        # In cache-sized blocks on the CPU: without tensor parallelism, whose statistics would then take
        # a collective per block.
        on_cpu = full["zs"].device.type == "cpu"
        self.block = block_rows(full) if self.chain is None and plan.group is None and on_cpu else None


def _temper(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in place; a pass over [C, V] saved at T = 1."""
    return logits if temperature == 1.0 else logits.div_(temperature)


def _full_width(scale_C: torch.Tensor, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """`scale_C` padded with zeros to the chunk buffers' rows (the compiled chain's one shape)."""
    return torch.cat([scale_C, scale_C.new_zeros(full["zs"].shape[0] - scale_C.shape[0])])


class _FusedLinearLoss(torch.autograd.Function):
    """The chunk loop every loss shares: student logits per chunk, the objective's value and gradient,
    the two gradient GEMMs. Gradients are formed in forward and scaled in backward."""

    @staticmethod
    def forward(
        ctx: Any, student_hidden: torch.Tensor, student_head: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hs_NH = operand(student_hidden.detach(), plan.native)
        ws_VH = operand(student_head.detach(), plan.native)
        num_tokens, local_vocab = hs_NH.shape[0], ws_VH.shape[0]
        device = hs_NH.device
        # Only the gradients autograd will ask for are formed (none under torch.no_grad: evaluation),
        # and both accumulate in fp32 whatever the inputs' dtype.
        fp32 = torch.float32
        grad_hs_NH = torch.zeros(hs_NH.shape, dtype=fp32, device=device) if ctx.needs_input_grad[0] else None
        grad_ws_VH = torch.zeros(ws_VH.shape, dtype=fp32, device=device) if ctx.needs_input_grad[1] else None
        values_N = torch.zeros(num_tokens, dtype=fp32, device=device)
        starts = plan.starts if plan.starts is not None else tuple(range(0, num_tokens, plan.chunk_size))
        stops = (*starts[1:], num_tokens)
        width = max((stop - start for start, stop in zip(starts, stops, strict=True)), default=0)
        full = {
            name: torch.empty(width, local_vocab, dtype=fp32, device=device)
            for name in plan.objective.buffer_names
        }
        plan.objective.prepare(full, plan)
        for start, stop in zip(starts, stops, strict=True):
            span = slice(start, stop)
            tokens_C = plan.order[span] if plan.order is not None else span
            zs = full["zs"][: span.stop - start]
            hs_CH = hs_NH[tokens_C]
            _temper(mm(hs_CH, ws_VH.T, out=zs), plan.temperature)
            if plan.valid is not None:
                zs.masked_fill_(~plan.valid, float("-inf"))
            # The chain rule's 1/T and the token weights scale the gradient inside the chain.
            scale_C = plan.weights[tokens_C] / plan.temperature
            value_C, grad_CV = plan.objective.value_and_grad(full, span, scale_C, plan)
            values_N[tokens_C] = value_C
            if grad_hs_NH is None and grad_ws_VH is None:
                continue
            parts = split_gradient(grad_CV, ws_VH.dtype)
            if grad_hs_NH is not None:
                grad_hs_CH = mm(parts[0], ws_VH, out=torch.empty(hs_CH.shape, dtype=fp32, device=device))
                for part in parts[1:]:
                    mm_add(part, ws_VH, grad_hs_CH)
                grad_hs_NH[tokens_C] = grad_hs_CH
            if grad_ws_VH is not None:
                for part in parts:
                    mm_add(part.T, hs_CH, grad_ws_VH)
        # Each rank holds the part of d loss / d h from its vocabulary slice; the full gradient is the
        # sum, as a column-parallel output layer's backward would produce. O(N · Hs) bytes, once.
        if grad_hs_NH is not None:
            all_reduce(grad_hs_NH, dist.ReduceOp.SUM, plan.group)
        ctx.save_for_backward(
            grad_hs_NH.to(student_hidden.dtype) if grad_hs_NH is not None else None,
            grad_ws_VH.to(student_head.dtype) if grad_ws_VH is not None else None,
        )
        ctx.mark_non_differentiable(values_N)
        return (plan.weights * values_N).sum(), values_N

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_values: torch.Tensor) -> tuple[Any, ...]:
        """The gradients formed in forward, scaled by the incoming gradient of the loss."""
        grad_hs, grad_ws = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_loss  # noqa: E731
        return scale(grad_hs), scale(grad_ws), None


def token_weights(weights: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """The [N] token weights of a call: as given (checked), or 1/N each."""
    if weights is None:
        return torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=device)
    if weights.shape != (num_tokens,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected ({num_tokens},)")
    return weights


def fused_loss(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    objective: _ChunkObjective,
    *,
    weights: torch.Tensor,
    temperature: float,
    chunk_size: int | Literal["auto"],
    valid: torch.Tensor | None,
    tp_group: Any,
    compiled: bool,
    order: torch.Tensor | None = None,
    starts: tuple[int, ...] | None = None,
) -> DivergenceOutput:
    """`objective` through the chunk loop every fused loss shares (`_FusedLinearLoss`)."""
    device = student_hidden.device
    plan = _Plan(
        objective=objective,
        order=order,
        weights=weights.detach().float(),
        temperature=float(temperature),
        chunk_size=chunk_size_for(chunk_size, device),
        valid=valid,
        group=tp_group,
        native=native_gemms(device),
        compiled=compiled,
        starts=starts,
    )
    loss, per_token = _FusedLinearLoss.apply(student_hidden, student_head, plan)
    return DivergenceOutput(loss=loss, per_token=per_token)


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
    chunk_size: int | Literal["auto"] = "auto",
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
    compiled: bool = False,
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
        chunk_size: tokens per chunk (peak extra memory O(chunk_size × V_local + N × Hs)); "auto": the
            trainer's rule, `chunk_chain.chunk_size_for`.
        tp_group: tensor-parallel process group over which the vocabulary is split (None: not split).
        vocab_start: first global vocabulary id of this rank's slice.
        vocab_size: global vocabulary size; columns at or past it are padding and excluded.
        teacher_transforms: {teacher: LogitTransform} logit scale / softcap per teacher.
        compiled: run each chunk's statistics, value and gradient as one compiled function (see
            `chunk_chain.should_compile`); without a tensor-parallel group only, eager otherwise.

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
    device = student_hidden.device
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    valid = valid_columns(vocab_start, local_vocab, vocab_size, device)
    order = torch.argsort(teacher_index, stable=True).to(device)  # group tokens by teacher
    transforms = {t: (teacher_transforms or {}).get(t, LogitTransform()) for t in rows}
    objective = _SoftTargets(
        kind,
        float(beta),
        teacher_index=teacher_index.to(device)[order],
        rows={t: r.detach() for t, r in rows.items()},
        heads={t: teacher_heads[t].detach() for t in rows},
        transforms=transforms,
    )
    return fused_loss(
        student_hidden,
        student_head,
        objective,
        weights=token_weights(weights, num_tokens, device),
        temperature=temperature,
        chunk_size=chunk_size,
        valid=valid,
        tp_group=tp_group,
        compiled=compiled,
        order=order,
    )
