"""Divergences against a teacher of another vocabulary, projected onto the student's (DESIGN §13).

The teacher's distribution over its own vocabulary is rebuilt chunk by chunk from its hidden states and
head, as in `divergence.py`, then carried onto this rank's slice of the student's vocabulary by a
sparse projection P (`mopd.tokens.projection`): log p̃(k) = logsumexp_j (log p_t(j) + log P[j, k]),
taken in log space (a max, then a sum of exps below it, per student token) so that a teacher whose tail
probabilities underflow fp32 still gives finite, exact log-probabilities for every student token it
reaches. The divergence itself is `chunk_chain`'s, over the student tokens the projection reaches on
any rank (the others are masked out of both softmaxes, like padded columns: a student token no teacher
token reaches has p̃ = 0, where reverse KL and cross-entropy would be infinite).

Tensor parallelism splits the student's vocabulary only: every rank rebuilds the whole teacher
distribution (its head whole, one GEMM of [C, V_t] per chunk, no collective: the teacher's statistics
are local) and projects it onto its own slice, so the projected mass of each student shard is formed
on its rank. The cost is the teacher GEMM repeated on each rank, in exchange for no [C, V] collective.

Legend: C tokens in a chunk, Vt the teacher's vocabulary, V this rank's student slice, E the
projection's entries landing in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from mopd.store.format.transform import LogitTransform
from mopd.tokens.projection import Projection
from mopd.train.kernel.chunk_chain import chunk_size_for
from mopd.train.kernel.divergence import (
    KINDS,
    DivergenceOutput,
    _FusedLinearLoss,
    _Plan,
    _SoftTargets,
    _temper,
)
from mopd.train.kernel.gemm import mm, native_gemms


@dataclass(frozen=True)
class LocalProjection:
    """The entries of a projection landing in one rank's student slice: teacher token `source[e]` gives
    weight exp(`log_weight[e]`) to local column `column[e]`; `reached` [V] marks columns with any."""

    source: torch.Tensor
    column: torch.Tensor
    log_weight: torch.Tensor
    reached: torch.Tensor
    teacher_vocab: int

    @classmethod
    def of(
        cls, projection: Projection, *, vocab_start: int, local_vocab: int, device: torch.device
    ) -> LocalProjection:
        keep = (
            (projection.target >= vocab_start)
            & (projection.target < vocab_start + local_vocab)
            & (projection.weight > 0)
        )
        column = (projection.target[keep] - vocab_start).to(device)
        reached = torch.zeros(local_vocab, dtype=torch.bool, device=device)
        reached[column] = True
        return cls(
            source=projection.source[keep].to(device),
            column=column,
            log_weight=projection.weight[keep].log().to(device),
            reached=reached,
            teacher_vocab=projection.teacher_vocab,
        )


def project_log_probs(logp_CVt: torch.Tensor, local: LocalProjection, out_CV: torch.Tensor) -> torch.Tensor:
    """log p̃ [C, V] = logsumexp over each column's entries of log p_t(source) + log weight, into `out_CV`
    (−inf where no entry lands). Per column, the largest term is subtracted before the exps: the sum of
    a column's exps is ≥ 1, so its log is finite whatever the teacher's tail."""
    rows = logp_CVt.shape[0]
    terms_CE = logp_CVt.index_select(1, local.source).add_(local.log_weight)
    column_CE = local.column.expand(rows, -1)
    out_CV.fill_(float("-inf")).scatter_reduce_(1, column_CE, terms_CE, "amax")
    terms_CE.sub_(out_CV.gather(1, column_CE)).exp_()
    sums_CV = torch.zeros_like(out_CV).scatter_add_(1, column_CE, terms_CE)
    return out_CV.add_(sums_CV.log_())


class _ProjectedTargets(_SoftTargets):
    """`_SoftTargets` whose teacher logits are the projected log-probabilities of one teacher."""

    def __init__(self, kind: str, beta: float, local: LocalProjection, **kwargs: Any) -> None:
        super().__init__(kind, beta, **kwargs)
        self.local = local

    def teacher_logits(
        self, hidden_CH: torch.Tensor, teacher: int, out_CV: torch.Tensor, plan: _Plan
    ) -> None:
        head = self._head(teacher, plan.native)
        shape = (hidden_CH.shape[0], head.shape[0])
        logits_CVt = mm(hidden_CH, head.T, out=torch.empty(shape, dtype=torch.float32, device=out_CV.device))
        _temper(self.transforms[teacher].apply_(logits_CVt), plan.temperature)
        logp_CVt = logits_CVt.sub_(torch.logsumexp(logits_CVt, 1, keepdim=True))  # the teacher's own softmax
        project_log_probs(logp_CVt, self.local, out_CV)


def _check_projected(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    projection: Projection,
    kind: str,
    temperature: float,
) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    num_tokens = student_hidden.shape[0]
    if teacher_hidden.shape[0] != num_tokens:
        raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} rows, student_hidden {num_tokens}")
    if teacher_hidden.shape[1] != teacher_head.shape[1]:
        raise ValueError(
            f"teacher hidden size {teacher_hidden.shape[1]} ≠ its head's {teacher_head.shape[1]}"
        )
    if teacher_head.shape[0] < projection.teacher_vocab:
        raise ValueError(
            f"the teacher head has {teacher_head.shape[0]} rows, the projection maps "
            f"{projection.teacher_vocab} tokens"
        )


def projected_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    projection: Projection,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weights: torch.Tensor | None = None,
    chunk_size: int | Literal["auto"] = "auto",
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    teacher_transform: LogitTransform | None = None,
    compiled: bool = False,
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_student,n ‖ P(p_teacher,n)) for a teacher of another vocabulary, fused and
    chunked like `linear_divergence` (no [N, V] or [N, Vt] tensor).

    Args:
        student_hidden: [N, Hs] (requires grad); student_head: [V_local, Hs] this rank's slice.
        teacher_hidden: [N, Ht] the teacher's hidden states at the positions aligned with the N tokens.
        teacher_head: [≥ Vt, Ht] the teacher's whole LM head (rows past the projection's teacher
            vocabulary are padding and ignored).
        projection: the teacher → student projection (`mopd.tokens.projection`), over the student's
            `vocab_size` tokens.
        kind, beta, temperature, weights, chunk_size, tp_group, vocab_start, vocab_size, compiled: as
            `linear_divergence`; teacher_transform: the teacher's logit scale / softcap.

    Returns:
        DivergenceOutput(loss with gradients to student_hidden and student_head, per_token values [N]).

    Raises:
        ValueError: unknown kind, shapes that do not match, a projection of other vocabulary sizes.
    """
    _check_projected(student_hidden, teacher_hidden, teacher_head, projection, kind, temperature)
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    if projection.student_vocab != vocab_size:
        raise ValueError(
            f"the projection maps onto {projection.student_vocab} student tokens, the vocabulary has "
            f"{vocab_size}"
        )
    device = student_hidden.device
    local = LocalProjection.of(projection, vocab_start=vocab_start, local_vocab=local_vocab, device=device)
    weights = (
        torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=device) if weights is None else weights
    )
    if weights.shape != (num_tokens,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected ({num_tokens},)")
    objective = _ProjectedTargets(
        kind,
        float(beta),
        local,
        teacher_index=torch.zeros(num_tokens, dtype=torch.long, device=device),
        rows={0: teacher_hidden.detach()},
        heads={0: teacher_head.detach()[: projection.teacher_vocab]},
        transforms={0: teacher_transform or LogitTransform()},
    )
    plan = _Plan(
        objective=objective,
        order=None,
        weights=weights.detach().float(),
        temperature=float(temperature),
        chunk_size=chunk_size_for(chunk_size, device),
        valid=local.reached,  # padded columns and columns no teacher token reaches: out of both softmaxes
        group=tp_group,
        native=native_gemms(device),
        compiled=compiled,
    )
    loss, per_token = _FusedLinearLoss.apply(student_hidden, student_head, plan)
    return DivergenceOutput(loss=loss, per_token=per_token)


def reference_projected_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    projection: Projection,
    **kwargs: Any,
) -> DivergenceOutput:
    """The unfused reference (tests only): the teacher's whole softmax, projected densely in log space,
    then `reference_divergence` over the student tokens the projection reaches."""
    from mopd.train.kernel.reference import reference_divergence

    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    temperature = float(kwargs.pop("temperature", 1.0))
    transform: LogitTransform = kwargs.pop("teacher_transform", None) or LogitTransform()
    zt = (
        transform.apply(teacher_hidden.to(dtype) @ teacher_head[: projection.teacher_vocab].to(dtype).T)
        / temperature
    )
    dense = torch.zeros(projection.teacher_vocab, projection.student_vocab, dtype=dtype)
    dense.index_put_((projection.source, projection.target), projection.weight.to(dtype), accumulate=True)
    # [N, Vt, Vs]: fine for the tests' vocabularies, which is what a reference is for.
    logp = torch.logsumexp(zt.log_softmax(-1)[:, :, None] + dense.log()[None], dim=1)
    reached = projection.reached()
    # The projected log-probabilities as "teacher logits" of an identity head over the reached columns.
    columns = reached.nonzero()[:, 0]
    return reference_divergence(
        student_hidden,
        student_head[columns],
        logp[:, columns] * temperature,  # divided by it again as "teacher logits"
        {0: torch.eye(columns.shape[0], dtype=dtype)},
        None,
        temperature=temperature,
        **kwargs,
    )
