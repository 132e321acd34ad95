"""Several teachers for one token (DESIGN §14): the mixture target Σ_k w_k p_k, rebuilt chunk by chunk
from each teacher's hidden rows and head and mixed in log space, then any divergence kind against it.

Per chunk of C tokens: one student GEMM (the shared loop), and per teacher one GEMM over the chunk's
tokens it scores, its log-softmax (statistics reduced over the tensor-parallel group, O(C) numbers) and
log w_k added, folded into the running log-mixture with `logaddexp`. Memory: the kernel's chunk buffers
plus one [C, V_local] buffer for the teacher being folded in, whatever the number of teachers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from mopd.store.format.transform import LogitTransform
from mopd.train.kernel.chunk_chain import NEEDS_P_T, all_reduce, chunk_size_for, soft_value_and_grad
from mopd.train.kernel.divergence import (
    KINDS,
    DivergenceOutput,
    _ChunkObjective,
    _Plan,
    _temper,
    fused_loss,
    token_weights,
    valid_columns,
)
from mopd.train.kernel.gemm import mm, operand


@dataclass(frozen=True)
class Member:
    """One teacher's part in an ensemble: the tokens it scores (ascending positions), its hidden rows
    for them, and its mixture weight at each (≥ 0; a token's weights need not sum to 1: they are
    normalised per token)."""

    positions: torch.Tensor  # [N_t] long
    hidden: torch.Tensor  # [N_t, H_t]
    weight: torch.Tensor  # [N_t]


class _Members(_ChunkObjective):
    """Teachers that each score some of the tokens (`Member`s): their heads made GEMM operands once,
    their tempered logits over a chunk's tokens, chunk by chunk."""

    def __init__(
        self,
        kind: str,
        beta: float,
        members: Mapping[int, Member],
        heads: Mapping[int, torch.Tensor],
        transforms: Mapping[int, LogitTransform],
        scratch: tuple[str, ...],
    ) -> None:
        self.kind, self.beta = kind, beta
        self.members, self.heads, self.transforms = members, heads, transforms
        names = ["zs", "zt", "ps"] + (["pt"] if kind in NEEDS_P_T else [])
        self.chain_names = tuple([*names, *(["work"] if kind in ("jsd", "tvd") else [])])
        self.buffer_names = (*self.chain_names, *scratch)
        self.operands: dict[int, torch.Tensor] = {}  # each head as a GEMM operand (`prepare`)

    def prepare(self, full: dict[str, torch.Tensor], plan: _Plan) -> None:
        # Every chunk meets every teacher: each head becomes a GEMM operand once, not once a chunk.
        self.operands = {t: operand(head, plan.native) for t, head in self.heads.items()}

    def scored(self, span: slice) -> Iterator[tuple[int, slice, torch.Tensor]]:
        """Each teacher that scores tokens of the chunk `span`: (teacher, its rows of them, their
        positions in the chunk)."""
        for t, member in self.members.items():
            first, stop = torch.searchsorted(member.positions, torch.tensor([span.start, span.stop])).tolist()
            if first < stop:
                yield t, slice(first, stop), member.positions[first:stop] - span.start

    def logits(self, t: int, rows: slice, out: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Teacher t's tempered logits of its hidden rows `rows` into `out` (padded columns −inf)."""
        mm(operand(self.members[t].hidden[rows], plan.native), self.operands[t].T, out=out)
        _temper(self.transforms[t].apply_(out), plan.temperature)
        if plan.valid is not None:
            out.masked_fill_(~plan.valid, float("-inf"))
        return out


class _MixtureTargets(_Members):
    """The divergence from each token's mixture of its teachers' (tempered) distributions."""

    def __init__(
        self,
        kind: str,
        beta: float,
        members: Mapping[int, Member],
        log_weights: Mapping[int, torch.Tensor],
        heads: Mapping[int, torch.Tensor],
        transforms: Mapping[int, LogitTransform],
    ) -> None:
        super().__init__(kind, beta, members, heads, transforms, scratch=("one",))
        self.log_weights = log_weights
        # Confident mixing: each weight times the teacher's probability of its own top token (T = 1);
        # each member's log of that product, and each token's log of their sum (for the shares).
        self.confident: dict[int, torch.Tensor] | None = None
        self.token_log_total: torch.Tensor | None = None

    def confide(self, num_tokens: int) -> None:
        self.confident = {t: torch.zeros(m.positions.shape[0]) for t, m in self.members.items()}
        self.token_log_total = torch.full((num_tokens,), float("-inf"))

    def _confidence(
        self, t: int, rows: slice, logits: torch.Tensor, lse: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """log(ŵ_k · max_v p_k(v)) at the rows, p_k at T = 1 (from the tempered `logits` and their
        log-sum-exp `lse`), recorded for the shares."""
        assert self.confident is not None
        top = all_reduce(logits.amax(1), dist.ReduceOp.MAX, plan.group)
        if plan.temperature != 1.0:  # back to T = 1: its own log-sum-exp
            top, lse = top * plan.temperature, _log_sum_exp(logits * plan.temperature, plan.group)
        log_weight = self.log_weights[t][rows] + top - lse
        self.confident[t][rows] = log_weight.cpu()
        return log_weight

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        buffers = {name: full[name][:size] for name in self.chain_names}
        mixture, started = buffers["zt"], False
        for t, rows, local in self.scored(span):
            # A teacher of every token of the chunk (ascending, each once: as many as the chunk) is
            # folded in place, the first such one written straight into the mixture: no [C, V] copy.
            whole = local.shape[0] == size
            first = whole and not started
            logits = self.logits(t, rows, mixture if first else full["one"][: rows.stop - rows.start], plan)
            lse = _log_sum_exp(logits, plan.group)
            log_weight = self.log_weights[t][rows]
            if self.confident is not None:
                log_weight = self._confidence(t, rows, logits, lse, plan)
                assert self.token_log_total is not None
                at = local + span.start
                self.token_log_total[at] = torch.logaddexp(self.token_log_total[at], log_weight.cpu())
            logits.add_((log_weight - lse)[:, None])
            if not started and not first:
                mixture.fill_(float("-inf"))
            started = True
            if first:
                continue
            if whole:
                torch.logaddexp(mixture, logits, out=mixture)
            else:
                local = local.to(mixture.device)
                mixture[local] = torch.logaddexp(mixture[local], logits)
        # Confident weights need no normalising here: the chain's log-softmax of the mixture removes any
        # per-token constant (their sum, kept for the shares).
        return soft_value_and_grad(buffers, plan.valid, self.kind, self.beta, scale_C, plan.group)


class _SumTargets(_Members):
    """Σ_k w_k D(p_student ‖ p_k) over each token's teachers: the student's logits once a chunk, then per
    teacher the divergence chain over the chunk's tokens it scores, the gradients summed with weight w_k.
    Two [C, V] buffers more than one teacher's (the student's logits kept, the summed gradient)."""

    def __init__(
        self,
        kind: str,
        beta: float,
        members: Mapping[int, Member],
        heads: Mapping[int, torch.Tensor],
        transforms: Mapping[int, LogitTransform],
    ) -> None:
        super().__init__(kind, beta, members, heads, transforms, scratch=("kept", "total"))
        self.values = {t: torch.zeros(m.positions.shape[0]) for t, m in members.items()}  # each D_k

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        kept = full["kept"][:size].copy_(full["zs"][:size])
        total = full["total"][:size].zero_()
        value = torch.zeros(size, device=kept.device)
        for t, rows, local in self.scored(span):
            local = local.to(kept.device)
            chain = {name: full[name][: rows.stop - rows.start] for name in self.chain_names}
            torch.index_select(kept, 0, local, out=chain["zs"])
            self.logits(t, rows, chain["zt"], plan)
            weight = self.members[t].weight[rows].to(kept.device)
            got, grad = soft_value_and_grad(
                chain, plan.valid, self.kind, self.beta, scale_C[local] * weight, plan.group
            )
            self.values[t][rows] = got.detach().cpu()
            value.index_add_(0, local, weight * got)
            total.index_add_(0, local, grad)
        return value, total


def _log_sum_exp(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """Each row's log Σ exp over the whole vocabulary (this rank's slice, reduced over the group)."""
    peak = all_reduce(logits.amax(1), dist.ReduceOp.MAX, group)
    total = all_reduce((logits - peak[:, None]).exp_().sum(1), dist.ReduceOp.SUM, group)
    return peak + total.log()


def _log_weights(members: Mapping[int, Member], num_tokens: int) -> dict[int, torch.Tensor]:
    """log(w_k / Σ_k w_k) of each member at its tokens.

    Raises:
        ValueError: a negative weight, or a token with no member of positive weight.
    """
    total = torch.zeros(num_tokens, dtype=torch.float64)
    for t, member in members.items():
        if (
            member.weight.shape != member.positions.shape
            or member.hidden.shape[0] != member.positions.shape[0]
        ):
            raise ValueError(f"teacher {t}: positions, hidden rows and weights must be as many")
        if bool((member.weight < 0).any()):
            raise ValueError(f"teacher {t} has a negative mixture weight")
        if member.positions.numel() and not bool((member.positions[1:] > member.positions[:-1]).all()):
            raise ValueError(f"teacher {t}: positions must ascend, each token once")
        total.index_add_(0, member.positions.cpu(), member.weight.detach().cpu().double())
    if bool((total <= 0).any()):
        token = int((total <= 0).nonzero()[0])
        raise ValueError(f"token {token} has no teacher of positive weight; every token needs one")
    return {
        t: (m.weight.detach().cpu().double() / total[m.positions.cpu()]).log().float()
        for t, m in members.items()
    }


def mixture_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    members: Mapping[int, Member],
    teacher_heads: Mapping[int, torch.Tensor],
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
    combine: Literal["mixture", "sum"] = "mixture",
    confident: bool = False,
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_student,n ‖ Σ_k w_k,n p_k,n) without any [N, V] tensor: each token's target
    is the mixture of the (tempered) distributions of the teachers that score it (`members`), with
    their weights normalised per token. Arguments as `divergence.linear_divergence`'s.

    With `combine="sum"`: Σ_n weights_n Σ_k w_k,n · D(p_student,n ‖ p_k,n) instead (the members'
    weights as given, not normalised), in the same one pass over the chunks; the output's per-token
    values are Σ_k w_k D_k and its `by_teacher` each teacher's own D_k at its tokens. With `confident`
    (a mixture): each weight is multiplied by the teacher's probability of its own top token (at T = 1)
    before the per-token normalisation, in the same pass; `by_teacher` holds each teacher's normalised
    weight at its tokens.

    Raises:
        ValueError: unknown kind, a teacher without a head, weights or positions that do not fit, or a
            token no teacher scores.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    missing = sorted(set(members) - set(teacher_heads))
    if missing:
        raise ValueError(f"teacher {missing[0]} scores tokens but no head was given for it")
    device = student_hidden.device
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    given = {t: Member(m.positions.cpu(), m.hidden.detach(), m.weight.detach()) for t, m in members.items()}
    heads = {t: teacher_heads[t].detach() for t in members}
    transforms = {t: (teacher_transforms or {}).get(t, LogitTransform()) for t in members}
    objective: _MixtureTargets | _SumTargets
    if combine == "sum":
        objective = _SumTargets(kind, float(beta), given, heads, transforms)
    else:
        log_weights = {t: w.to(device) for t, w in _log_weights(members, num_tokens).items()}
        objective = _MixtureTargets(kind, float(beta), given, log_weights, heads, transforms)
        if confident:
            objective.confide(num_tokens)
    out = fused_loss(
        student_hidden,
        student_head,
        objective,
        weights=token_weights(weights, num_tokens, device),
        temperature=temperature,
        chunk_size=chunk_size,
        valid=valid_columns(vocab_start, local_vocab, vocab_size, device),
        tp_group=tp_group,
        compiled=False,
    )
    if isinstance(objective, _SumTargets):
        return replace(out, by_teacher=objective.values)
    if objective.confident is not None and objective.token_log_total is not None:
        total = objective.token_log_total
        shares = {t: (w - total[given[t].positions]).exp() for t, w in objective.confident.items()}
        return replace(out, by_teacher=shares)
    return out


@torch.no_grad()
def next_token_log_probs(
    hidden_NH: torch.Tensor,
    head: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    transform: LogitTransform | None = None,
    chunk_size: int | Literal["auto"] = "auto",
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """[N] a teacher's log-probability (its own distribution, T = 1, transform applied) of each token's
    label, −inf where the label is negative. Chunked over tokens, the vocabulary split over `tp_group`
    as the divergence's (O(chunk × V_local) memory; the statistics reduced over the group). No gradient.
    """
    device = hidden_NH.device
    local_vocab = head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    valid = valid_columns(
        vocab_start, local_vocab, local_vocab * tp_size if vocab_size is None else vocab_size, device
    )
    chunk = chunk_size_for(chunk_size, device)
    label_N = torch.full((hidden_NH.shape[0],), float("-inf"), device=device)
    weights = head.float()
    for start in range(0, hidden_NH.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = (transform or LogitTransform()).apply_(hidden_NH[rows].float() @ weights.T)
        if valid is not None:
            logits.masked_fill_(~valid, float("-inf"))
        normaliser = _log_sum_exp(logits, tp_group)
        local = labels_N[rows].to(device) - vocab_start
        here = (local >= 0) & (local < local_vocab)
        picked = torch.where(here, logits.gather(1, local.clamp(0, local_vocab - 1)[:, None])[:, 0], 0.0)
        picked = all_reduce(picked, dist.ReduceOp.SUM, tp_group)
        label_N[rows] = torch.where(labels_N[rows].to(device) >= 0, picked - normaliser, float("-inf"))
    return label_N
