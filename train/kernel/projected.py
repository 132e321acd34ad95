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
projection's entries landing in it, K the columns that several entries reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from mopd.store.format.transform import LogitTransform
from mopd.tokens.projection import Projection
from mopd.train.kernel.divergence import (
    KINDS,
    DivergenceOutput,
    _Plan,
    _SoftTargets,
    _temper,
    fused_loss,
    token_weights,
)
from mopd.train.kernel.gemm import mm


@dataclass(frozen=True)
class LocalProjection:
    """The entries of a projection landing in one rank's student slice, split by what their column
    needs. A column reached by one entry takes that entry's term as it is (`single_*`: teacher token,
    local column, log weight); a column reached by several takes a log-sum-exp over them (`multi_*`:
    teacher token, the column's slot in `multi_columns`, log weight). `reached` [V] marks columns with
    any entry."""

    single_source: torch.Tensor
    single_column: torch.Tensor
    single_log_weight: torch.Tensor
    multi_source: torch.Tensor
    multi_slot: torch.Tensor
    multi_log_weight: torch.Tensor
    multi_columns: torch.Tensor
    reached: torch.Tensor

    @classmethod
    def of(
        cls, projection: Projection, *, vocab_start: int, local_vocab: int, device: torch.device
    ) -> LocalProjection:
        keep = (
            (projection.target >= vocab_start)
            & (projection.target < vocab_start + local_vocab)
            & (projection.weight > 0)
        )
        source, column = projection.source[keep], projection.target[keep] - vocab_start
        log_weight = projection.weight[keep].log()
        counts = torch.bincount(column, minlength=local_vocab)
        single = counts[column] == 1
        multi_columns, multi_slot = torch.unique(column[~single], return_inverse=True)
        return cls(
            single_source=source[single].to(device),
            single_column=column[single].to(device),
            single_log_weight=log_weight[single].to(device),
            multi_source=source[~single].to(device),
            multi_slot=multi_slot.to(device),
            multi_log_weight=log_weight[~single].to(device),
            multi_columns=multi_columns.to(device),
            reached=(counts > 0).to(device),
        )


def project_log_probs(logp_VtC: torch.Tensor, local: LocalProjection, out_CV: torch.Tensor) -> torch.Tensor:
    """log p̃ [C, V] = logsumexp over each column's entries of log p_t(source) + log weight, into `out_CV`
    (−inf where no entry lands), from the teacher's log-probabilities laid out [Vt, C].

    A column of several entries has its largest term subtracted before the exps: the sum of its exps
    is then ≥ 1, so its log is finite whatever the teacher's tail. The work runs in the [vocabulary, C]
    layout, whole rows of C at a time: gathering and scattering single elements along the vocabulary
    of a [C, V] tensor is several times slower on a CPU (bench/README.md, "Cross-tokenizer kernel").
    """
    columns = out_CV.shape[1]
    out_VC = torch.full((columns, out_CV.shape[0]), float("-inf"), dtype=out_CV.dtype, device=out_CV.device)
    singles_EC = logp_VtC.index_select(0, local.single_source).add_(local.single_log_weight[:, None])
    out_VC.index_copy_(0, local.single_column, singles_EC)
    if local.multi_columns.numel():
        terms_EC = logp_VtC.index_select(0, local.multi_source).add_(local.multi_log_weight[:, None])
        slot_EC = local.multi_slot[:, None].expand(-1, terms_EC.shape[1])
        shape = (local.multi_columns.shape[0], terms_EC.shape[1])
        max_KC = torch.full(shape, float("-inf"), dtype=terms_EC.dtype, device=terms_EC.device)
        max_KC.scatter_reduce_(0, slot_EC, terms_EC, "amax")
        terms_EC.sub_(max_KC.index_select(0, local.multi_slot)).exp_()
        sums_KC = torch.zeros(shape, dtype=terms_EC.dtype, device=terms_EC.device)
        sums_KC.index_add_(0, local.multi_slot, terms_EC)
        out_VC.index_copy_(0, local.multi_columns, max_KC.add_(sums_KC.log_()))
    return out_CV.copy_(out_VC.T)


class _ProjectedTargets(_SoftTargets):
    """`_SoftTargets` whose teacher logits are the projected log-probabilities of one teacher."""

    def __init__(self, kind: str, beta: float, local: LocalProjection, **kwargs: Any) -> None:
        super().__init__(kind, beta, **kwargs)
        self.local = local

    def teacher_logits(
        self, hidden_CH: torch.Tensor, teacher: int, out_CV: torch.Tensor, plan: _Plan
    ) -> None:
        # The teacher's logits laid out [Vt, C] (the same GEMM, transposed), so that the projection
        # reads and writes whole rows; its softmax is per column.
        head = self._head(teacher, plan.native)
        shape = (head.shape[0], hidden_CH.shape[0])
        logits_VtC = mm(head, hidden_CH.T, out=torch.empty(shape, dtype=torch.float32, device=out_CV.device))
        _temper(self.transforms[teacher].apply_(logits_VtC), plan.temperature)
        logp_VtC = logits_VtC.sub_(torch.logsumexp(logits_VtC, 0, keepdim=True))
        project_log_probs(logp_VtC, self.local, out_CV)


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
    objective = _ProjectedTargets(
        kind,
        float(beta),
        local,
        teacher_index=torch.zeros(num_tokens, dtype=torch.long, device=device),
        rows={0: teacher_hidden.detach()},
        heads={0: teacher_head.detach()[: projection.teacher_vocab]},
        transforms={0: teacher_transform or LogitTransform()},
    )
    return fused_loss(
        student_hidden,
        student_head,
        objective,
        weights=token_weights(weights, num_tokens, device),
        temperature=temperature,
        chunk_size=chunk_size,
        valid=local.reached,  # padded columns and columns no teacher token reaches: out of both softmaxes
        tp_group=tp_group,
        compiled=compiled,
    )


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
    from mopd.train.kernel.reference import projected_log_probs, reference_divergence

    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    temperature = float(kwargs.pop("temperature", 1.0))
    transform: LogitTransform = kwargs.pop("teacher_transform", None) or LogitTransform()
    zt = (
        transform.apply(teacher_hidden.to(dtype) @ teacher_head[: projection.teacher_vocab].to(dtype).T)
        / temperature
    )
    logp = projected_log_probs(zt.log_softmax(-1), projection)
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
