"""Several teachers for one token (DESIGN §14): each token's target rebuilt chunk by chunk from the
hidden rows and heads of the teachers that score it — their mixture Σ_k w_k p_k mixed in log space, the
one most likely to emit the next token (`min_ce`), or each in turn (`sum`) — then any divergence kind
against it. A teacher of another vocabulary enters projected onto the student's (projected first, then
combined).

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
from mopd.tokens.projection import Projection
from mopd.train.kernel.chunk_chain import (
    NEEDS_P_T,
    all_reduce,
    block_rows,
    soft_in_blocks,
    soft_value_and_grad,
)
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
from mopd.train.kernel.projected import LocalProjection, project_log_probs


@dataclass(frozen=True)
class Member:
    """One teacher's part in an ensemble: the tokens it scores (ascending positions), its hidden rows
    for them, and its mixture weight at each (≥ 0; a token's weights need not sum to 1: they are
    normalised per token)."""

    positions: torch.Tensor  # [N_t] long
    hidden: torch.Tensor  # [N_t, H_t]
    weight: torch.Tensor  # [N_t]
    # A teacher of another vocabulary: its distribution projected onto the student's (DESIGN §13).
    projection: Projection | None = None


class _Members(_ChunkObjective):
    """Teachers that each score some of the tokens (`Member`s): their heads made GEMM operands once,
    their tempered logits over a chunk's tokens, chunk by chunk. A teacher of another vocabulary gives
    its projected log-probabilities in place of logits (projected first, then combined); the columns a
    token's target reaches none of leave both softmaxes, token by token (`chain`), as the routed
    projected kernel leaves out the columns its projection reaches none of."""

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
        self.local: dict[int, LocalProjection] = {}  # each projection's entries in this rank's slice

    def project(self, local: Mapping[int, LocalProjection]) -> None:
        self.local = dict(local)

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

    def output(self, out: DivergenceOutput) -> DivergenceOutput:
        """The kernel's output with what this objective recorded on the way."""
        return out

    def chain(
        self, buffers: dict[str, torch.Tensor], scale_C: torch.Tensor, plan: _Plan, *, projected: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The divergence chain over filled buffers: in cache-sized blocks on the CPU without tensor
        parallelism (as the routed kernel's eager chain), whole otherwise. Where a projected teacher
        made the targets, each token's columns its target reaches none of (−inf) leave both sides."""
        valid = plan.valid
        if projected:
            valid = buffers["zt"] > float("-inf")
            buffers["zs"].masked_fill_(~valid, float("-inf"))
        if plan.group is None and buffers["zs"].device.type == "cpu":
            rows = block_rows(buffers)
            return soft_in_blocks(buffers, rows, valid, self.kind, self.beta, scale_C)
        return soft_value_and_grad(buffers, valid, self.kind, self.beta, scale_C, plan.group)

    def logits(self, t: int, rows: slice, out: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Teacher t's logits (T = 1) of its hidden rows `rows` over this rank's slice of the student's
        vocabulary into `out` (padded columns −inf): a projected teacher's are its log-probabilities
        (columns it reaches none of −inf). The caller tempers them (`temper`), after taking any
        statistic of the teacher's own distribution."""
        if t in self.local:
            return self._projected(t, rows, out, plan, 1.0)
        mm(operand(self.members[t].hidden[rows], plan.native), self.operands[t].T, out=out)
        self.transforms[t].apply_(out)
        if plan.valid is not None:
            out.masked_fill_(~plan.valid, float("-inf"))
        return out

    def temper(self, t: int, rows: slice, logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """`logits` (from `logits`) at the plan's temperature, in place: divided by it, or for a projected
        teacher its tempered distribution projected afresh (a projection of a tempered distribution is
        not a tempered projection)."""
        if plan.temperature == 1.0:
            return logits
        if t in self.local:
            return self._projected(t, rows, logits, plan, plan.temperature)
        return logits.div_(plan.temperature)

    def _projected(
        self, t: int, rows: slice, out: torch.Tensor, plan: _Plan, temperature: float
    ) -> torch.Tensor:
        """Teacher t's log-probabilities at `temperature`, projected onto this rank's slice, into `out`:
        its logits laid out [Vt, C] (as `projected.py`), their log-softmax over its whole vocabulary."""
        hidden = operand(self.members[t].hidden[rows], plan.native)
        head = self.operands[t]
        shape = (head.shape[0], hidden.shape[0])
        logits_VtC = mm(head, hidden.T, out=torch.empty(shape, dtype=torch.float32, device=out.device))
        _temper(self.transforms[t].apply_(logits_VtC), temperature)
        logp_VtC = logits_VtC.sub_(torch.logsumexp(logits_VtC, 0, keepdim=True))
        return project_log_probs(logp_VtC, self.local[t], out)


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

    def output(self, out: DivergenceOutput) -> DivergenceOutput:
        if self.confident is None or self.token_log_total is None:
            return out
        total = self.token_log_total
        shares = {t: (w - total[self.members[t].positions]).exp() for t, w in self.confident.items()}
        return replace(out, by_teacher=shares)

    def _confidence(
        self, t: int, rows: slice, logits: torch.Tensor, lse: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """log(ŵ_k · max_v p_k(v)) at the rows, p_k at T = 1 (the untempered `logits` and their
        log-sum-exp `lse`), recorded for the shares."""
        assert self.confident is not None
        top = all_reduce(logits.amax(1), dist.ReduceOp.MAX, plan.group)
        log_weight = self.log_weights[t][rows] + top - lse
        self.confident[t][rows] = log_weight.cpu()
        return log_weight

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        buffers = {name: full[name][:size] for name in self.chain_names}
        mixture, started = buffers["zt"], False
        scored = list(self.scored(span))
        for t, rows, local in scored:
            # A teacher of every token of the chunk (ascending, each once: as many as the chunk) is
            # folded in place, the first such one written straight into the mixture: no [C, V] copy.
            whole = local.shape[0] == size
            first = whole and not started
            logits = self.logits(t, rows, mixture if first else full["one"][: rows.stop - rows.start], plan)
            log_weight, lse = self.log_weights[t][rows], None
            if self.confident is not None:
                lse = _log_sum_exp(logits, plan.group, buffers["ps"])  # at T = 1
                log_weight = self._confidence(t, rows, logits, lse, plan)
                assert self.token_log_total is not None
                at = local + span.start
                self.token_log_total[at] = torch.logaddexp(self.token_log_total[at], log_weight.cpu())
            if lse is None or plan.temperature != 1.0:
                lse = _log_sum_exp(self.temper(t, rows, logits, plan), plan.group, buffers["ps"])
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
        return self.chain(buffers, scale_C, plan, projected=any(t in self.local for t, _, _ in scored))


class _ChoiceTargets(_Members):
    """Per token, the divergence from the one teacher most likely to emit its next token (T = 1; the
    lowest index on a tie and where there is no next token), weighing that teacher's weight. Chosen in
    the same pass: each teacher's logits once a chunk, its rows that beat the best so far copied over
    the target in place; one chain over the chosen targets."""

    def __init__(
        self,
        kind: str,
        beta: float,
        members: Mapping[int, Member],
        heads: Mapping[int, torch.Tensor],
        transforms: Mapping[int, LogitTransform],
        labels: tuple[torch.Tensor, int],
    ) -> None:
        super().__init__(kind, beta, members, heads, transforms, scratch=("one",))
        self.labels, self.vocab_start = labels  # [N] each token's next token (negative: none)
        self.chosen = torch.full(self.labels.shape, -1, dtype=torch.long)  # each token's teacher
        self.values = torch.zeros(self.labels.shape)  # each token's divergence from its teacher

    def output(self, out: DivergenceOutput) -> DivergenceOutput:
        picked = {t: (self.chosen[m.positions] == t).float() for t, m in self.members.items()}
        return replace(out, per_token=self.values.to(out.per_token.device), by_teacher=picked)

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        buffers = {name: full[name][:size] for name in self.chain_names}
        target, device = buffers["zt"], buffers["zt"].device
        best = torch.full((size,), float("-inf"), device=device)
        chosen = torch.full((size,), -1, dtype=torch.long, device=device)
        weight = torch.zeros(size, device=device)
        scored = list(self.scored(span))
        for t, rows, local in scored:
            local = local.to(device)
            # The first teacher of every token of the chunk is written straight into the target.
            first = local.shape[0] == size and bool((chosen < 0).all())
            logits = self.logits(t, rows, target if first else full["one"][: rows.stop - rows.start], plan)
            labels = self.labels[span][local]
            score = _label_log_probs(logits, labels, self.vocab_start, plan.group, buffers["ps"])
            score = torch.where(labels >= 0, score, 0.0)  # no next token: a tie
            wins = (score > best[local]) | (chosen[local] < 0)  # ascending teachers: a tie keeps the first
            at = local[wins]
            best[at], chosen[at] = score[wins], t
            weight[at] = self.members[t].weight[rows].to(device)[wins]
            logits = self.temper(t, rows, logits, plan)
            if not first:  # the winners' rows through a free chunk buffer: no allocation
                won = torch.index_select(logits, 0, wins.nonzero()[:, 0], out=buffers["ps"][: at.shape[0]])
                target.index_copy_(0, at, won)
        scale_C = scale_C * weight
        value, grad = self.chain(buffers, scale_C, plan, projected=any(t in self.local for t, _, _ in scored))
        self.values[span], self.chosen[span] = value.detach().cpu(), chosen.cpu()
        return value * weight, grad


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

    def output(self, out: DivergenceOutput) -> DivergenceOutput:
        return replace(out, by_teacher=self.values)

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
            self.temper(t, rows, self.logits(t, rows, chain["zt"], plan), plan)
            weight = self.members[t].weight[rows].to(kept.device)
            got, grad = self.chain(chain, scale_C[local] * weight, plan, projected=t in self.local)
            self.values[t][rows] = got.detach().cpu()
            value.index_add_(0, local, weight * got)
            total.index_add_(0, local, grad)
        return value, total


def _log_sum_exp(logits: torch.Tensor, group: Any, scratch: torch.Tensor) -> torch.Tensor:
    """Each row's log Σ exp over the whole vocabulary (this rank's slice, reduced over the group); the
    exps go to `scratch` (a chunk buffer free at that point: no [C, V] allocation a teacher)."""
    peak = all_reduce(logits.amax(1), dist.ReduceOp.MAX, group)
    exps = torch.sub(logits, peak[:, None], out=scratch[: logits.shape[0]]).exp_()
    return peak + all_reduce(exps.sum(1), dist.ReduceOp.SUM, group).log()


def _label_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: Any, scratch: torch.Tensor
) -> torch.Tensor:
    """Each row's log-probability of its label under `logits` (this rank's slice of the vocabulary,
    from `vocab_start`; reduced over the group); a negative label gives a finite number to ignore."""
    local = labels - vocab_start
    here = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    picked = all_reduce(torch.where(here, picked, 0.0), dist.ReduceOp.SUM, group)
    return picked - _log_sum_exp(logits, group, scratch)


def _weight_totals(members: Mapping[int, Member], num_tokens: int) -> torch.Tensor:
    """Each token's Σ_k w_k over its members (float64, on the CPU).

    Raises:
        ValueError: members whose positions, rows and weights do not fit, a negative weight, or a token
            no member scores.
    """
    total = torch.zeros(num_tokens, dtype=torch.float64)
    count = torch.zeros(num_tokens, dtype=torch.long)
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
        count.index_add_(0, member.positions.cpu(), torch.ones_like(member.positions.cpu()))
    if bool((count == 0).any()):
        raise ValueError(f"token {int((count == 0).nonzero()[0])} has no teacher; every token needs one")
    return total


def _log_weights(members: Mapping[int, Member], total: torch.Tensor) -> dict[int, torch.Tensor]:
    """log(w_k / Σ_k w_k) of each member at its tokens, `total` each token's Σ_k w_k.

    Raises:
        ValueError: a token whose members all weigh 0 (a mixture of none).
    """
    if bool((total <= 0).any()):
        token = int((total <= 0).nonzero()[0])
        raise ValueError(f"token {token} has no teacher of positive weight; every token needs one")
    return {
        t: (m.weight.detach().cpu().double() / total[m.positions.cpu()]).log().float()
        for t, m in members.items()
    }


def _given(
    members: Mapping[int, Member], teacher_heads: Mapping[int, torch.Tensor], vocab_size: int
) -> tuple[dict[int, Member], dict[int, torch.Tensor]]:
    """The members detached (positions on the CPU) and their heads (a projected teacher's without the
    padding rows past its vocabulary).

    Raises:
        ValueError: a teacher without a head, or a projection that does not fit its head or the
            student's vocabulary.
    """
    missing = sorted(set(members) - set(teacher_heads))
    if missing:
        raise ValueError(f"teacher {missing[0]} scores tokens but no head was given for it")
    given, heads = {}, {}
    for t, m in members.items():
        given[t] = replace(m, positions=m.positions.cpu(), hidden=m.hidden.detach(), weight=m.weight.detach())
        heads[t] = teacher_heads[t].detach()
        if m.projection is None:
            continue
        if m.projection.student_vocab != vocab_size or heads[t].shape[0] < m.projection.teacher_vocab:
            raise ValueError(
                f"teacher {t}'s projection maps {m.projection.teacher_vocab} tokens onto "
                f"{m.projection.student_vocab}; its head has {heads[t].shape[0]} rows and the student's "
                f"vocabulary {vocab_size} tokens"
            )
        heads[t] = heads[t][: m.projection.teacher_vocab]
    return given, heads


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
    combine: Literal["mixture", "sum", "min_ce"] = "mixture",
    confident: bool = False,
    labels: torch.Tensor | None = None,
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_student,n ‖ Σ_k w_k,n p_k,n) without any [N, V] tensor: each token's target
    is the mixture of the (tempered) distributions of the teachers that score it (`members`), with
    their weights normalised per token. Arguments as `divergence.linear_divergence`'s.

    With `combine="sum"`: Σ_n weights_n Σ_k w_k,n · D(p_student,n ‖ p_k,n) instead (the members'
    weights as given, not normalised), in the same one pass over the chunks; the output's per-token
    values are Σ_k w_k D_k and its `by_teacher` each teacher's own D_k at its tokens. With `confident`
    (a mixture): each weight is multiplied by the teacher's probability of its own top token (at T = 1)
    before the per-token normalisation, in the same pass; `by_teacher` holds each teacher's normalised
    weight at its tokens. With `combine="min_ce"` and `labels` [N] (each token's next token, negative
    where there is none): Σ_n weights_n w_k*,n D(p_student,n ‖ p_k*,n), k* the member with the highest
    p_k(label) at T = 1 (the lowest index on a tie or without a label), chosen in the same pass; the
    per-token values are D to k*, and `by_teacher` is 1 where a member was chosen, 0 elsewhere.

    Raises:
        ValueError: unknown kind, a teacher without a head, weights or positions that do not fit, or a
            token no teacher scores.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = student_hidden.device
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    given, heads = _given(members, teacher_heads, vocab_size)
    transforms = {t: (teacher_transforms or {}).get(t, LogitTransform()) for t in members}
    total = _weight_totals(given, num_tokens)
    objective: _MixtureTargets | _SumTargets | _ChoiceTargets
    if combine == "sum":
        objective = _SumTargets(kind, float(beta), given, heads, transforms)
    elif combine == "min_ce":
        if labels is None or labels.shape != (num_tokens,):
            raise ValueError(f"min_ce needs labels of shape ({num_tokens},), one a token")
        chosen_by = (labels.to(device), vocab_start)
        objective = _ChoiceTargets(kind, float(beta), given, heads, transforms, chosen_by)
    else:
        log_weights = {t: w.to(device) for t, w in _log_weights(given, total).items()}
        objective = _MixtureTargets(kind, float(beta), given, log_weights, heads, transforms)
        if confident:
            objective.confide(num_tokens)
    where = dict(vocab_start=vocab_start, local_vocab=local_vocab, device=device)
    objective.project(
        {t: LocalProjection.of(m.projection, **where) for t, m in given.items() if m.projection is not None}
    )
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
    return objective.output(out)
