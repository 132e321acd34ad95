"""The span log-likelihood match of a teacher of another vocabulary (DESIGN §13).

A span is a run of the trained text whose ends are token boundaries of both tokenisations
(`mopd.tokens.alignment`): the student spells it in its tokens, the teacher in its own, and both assign
it a log-likelihood — the sum of each model's log-probabilities of its own tokens of the span. Those
two numbers are comparable across vocabularies where single distributions are not, so positions no
aligned teacher position supervises still get a signal:

    loss = Σ_s w_s · ½ (ℓ_student(s) − ℓ_teacher(s))²

Both likelihoods are taken at temperature 1 (a likelihood of text, not a softened distribution). The
student's side runs through the fused chunk loop (`divergence.fused_loss`) in one pass, never an [N, V]
tensor: its chunks end where spans do, so each span's likelihood is summed inside its chunk before its
tokens' gradients — the hard label's, scaled by the span's d loss / d ℓ — are formed (one GEMM for the
logits and two for the gradients, as for any fused loss). The teacher's side needs no gradient: its
log-probabilities of its own next tokens, chunk by chunk.

Legend: N student positions, M teacher positions, S spans, C tokens in a chunk, Vt the teacher's
vocabulary.
"""

from __future__ import annotations

import bisect
from typing import Any, Literal

import torch
import torch.distributed as dist

from mopd.store.format.transform import LogitTransform
from mopd.train.kernel.chunk_chain import chunk_size_for, label_grad, label_values
from mopd.train.kernel.divergence import (
    DivergenceOutput,
    _ChunkObjective,
    _Plan,
    fused_loss,
    valid_columns,
)


def span_sums(values_N: torch.Tensor, span_N: torch.Tensor, num_spans: int) -> torch.Tensor:
    """[S] sums of each span's values; positions of span −1 belong to none."""
    inside = span_N >= 0
    out = torch.zeros(num_spans, dtype=torch.float64, device=values_N.device)
    return out.index_add_(0, span_N[inside], values_N[inside].double())


@torch.no_grad()
def teacher_log_probs(
    hidden_MH: torch.Tensor,
    head_VH: torch.Tensor,
    targets_M: torch.Tensor,
    *,
    transform: LogitTransform | None = None,
    chunk_size: int | Literal["auto"] = "auto",
) -> torch.Tensor:
    """[M] log p_teacher(target) at each position, fp32 logits from the GEMM (no gradient).

    Args:
        hidden_MH: the teacher's hidden states at M positions; head_VH: its whole LM head, cut to its
            vocabulary; targets_M: the teacher's own next token at each position.
        transform: the teacher's logit scale / softcap.
    """
    chunk = chunk_size_for(chunk_size, hidden_MH.device)
    out = torch.empty(hidden_MH.shape[0], dtype=torch.float32, device=hidden_MH.device)
    head = head_VH.float()
    for start in range(0, hidden_MH.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits_CV = (transform or LogitTransform()).apply_(hidden_MH[rows].float() @ head.T)
        picked_C = logits_CV.gather(1, targets_M[rows, None].to(logits_CV.device))[:, 0]
        out[rows] = picked_C - torch.logsumexp(logits_CV, 1)
    return out


class _SpanLikelihood(_ChunkObjective):
    """The span loss in one pass over the student's logits: each chunk holds whole spans, so a span's
    student log-likelihood is known inside its chunk before its tokens' gradients are formed. A span's
    loss is the value of its first token (the driver's token weights are all 1)."""

    def __init__(
        self,
        targets: torch.Tensor,
        span_of: torch.Tensor,
        teacher_likelihood: torch.Tensor,
        span_weights: torch.Tensor,
        vocab_start: int,
    ) -> None:
        self.targets, self.span_of, self.vocab_start = targets, span_of, vocab_start
        self.teacher_likelihood = teacher_likelihood.double()
        self.span_weights = span_weights.double()
        self.per_span = torch.zeros_like(self.teacher_likelihood)  # ½ (ℓ_student − ℓ_teacher)²

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        nll_C, parts = label_values(full["zs"][:size], self.targets[span] - self.vocab_start, plan.group)
        span_C = self.span_of[span]
        first, stop = int(span_C[0]), int(span_C[-1]) + 1
        local_C = span_C - first
        student_K = torch.zeros(stop - first, dtype=torch.float64, device=nll_C.device)
        gap_K = student_K.index_add_(0, local_C, -nll_C.double()) - self.teacher_likelihood[first:stop]
        self.per_span[first:stop] = 0.5 * gap_K.square()
        # d loss / d ℓ_student(s) = w_s · gap_s, and ℓ_student is −Σ of the tokens' values: each token's
        # value gradient is scaled by −w_s · gap_s.
        slope_K = self.span_weights[first:stop] * gap_K
        grad_CV = label_grad(parts, -slope_K[local_C].float() * scale_C)
        opens_C = torch.ones(size, dtype=torch.bool, device=nll_C.device)
        opens_C[1:] = span_C[1:] != span_C[:-1]
        value_C = torch.zeros(size, device=nll_C.device)
        value_C[opens_C] = (self.span_weights[first:stop] * self.per_span[first:stop]).float()
        return value_C, grad_CV


def span_chunks(span_of: torch.Tensor, chunk: int) -> tuple[int, ...]:
    """Chunk starts that no span straddles: each chunk ends at the last span start within `chunk` tokens
    of its own start (a span longer than a chunk: at that span's end). `span_of` is non-decreasing."""
    count = span_of.shape[0]
    opens = torch.ones(count, dtype=torch.bool)
    opens[1:] = span_of[1:].cpu() != span_of[:-1].cpu()
    boundaries = [*opens.nonzero()[:, 0].tolist(), count]
    starts, at = [], 0
    while at < count:
        starts.append(at)
        end = boundaries[bisect.bisect_right(boundaries, at + chunk) - 1]
        at = end if end > at else boundaries[bisect.bisect_right(boundaries, at)]
    return tuple(starts)


def span_likelihood_match(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    targets: torch.Tensor,
    span_of: torch.Tensor,
    teacher_likelihood: torch.Tensor,
    span_weights: torch.Tensor,
    *,
    chunk_size: int | Literal["auto"] = "auto",
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> DivergenceOutput:
    """Σ_s span_weights_s · ½ (ℓ_student(s) − teacher_likelihood_s)², with gradients to the student.

    Args:
        student_hidden: [N, Hs] (requires grad); student_head: [V_local, Hs] this rank's slice.
        targets: [N] the student's next token at each position (global ids).
        span_of: [N] the span of each position, −1 for none; a span's positions are consecutive and
            spans are numbered in position order (as `train.data.loader` numbers them).
        teacher_likelihood: [S] each span's teacher log-likelihood (`teacher_log_probs`, summed).
        span_weights: [S] each span's weight (mask × normaliser).
        chunk_size, tp_group, vocab_start, vocab_size: as `linear_divergence`.

    Returns:
        DivergenceOutput(loss, per_token = [S] each span's ½ (ℓ_student − ℓ_teacher)², detached).
    """
    num_spans = teacher_likelihood.shape[0]
    if span_weights.shape != (num_spans,):
        raise ValueError(f"span_weights has shape {tuple(span_weights.shape)}, expected ({num_spans},)")
    inside = (span_of >= 0).nonzero()[:, 0]
    span_of = span_of[inside]
    if span_of.numel() and (int(span_of.max()) >= num_spans or bool((span_of[1:] < span_of[:-1]).any())):
        raise ValueError(f"spans must be numbered 0 … {num_spans - 1} in position order")
    device = student_hidden.device
    local_vocab = student_head.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    objective = _SpanLikelihood(
        targets[inside].to(device), span_of.to(device), teacher_likelihood, span_weights, int(vocab_start)
    )
    out = fused_loss(
        student_hidden[inside.to(device)],
        student_head,
        objective,
        weights=torch.ones(span_of.shape[0], device=device),
        temperature=1.0,
        chunk_size=chunk_size,
        valid=valid_columns(vocab_start, local_vocab, vocab_size or local_vocab * tp_size, device),
        tp_group=tp_group,
        compiled=False,
        starts=span_chunks(span_of, chunk_size_for(chunk_size, device)),
    )
    return DivergenceOutput(loss=out.loss, per_token=objective.per_span.float())
