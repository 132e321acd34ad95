"""The span log-likelihood match of a teacher of another vocabulary (DESIGN §13).

A span is a run of the trained text whose ends are token boundaries of both tokenisations
(`mopd.tokens.alignment`): the student spells it in its tokens, the teacher in its own, and both assign
it a log-likelihood — the sum of each model's log-probabilities of its own tokens of the span. Those
two numbers are comparable across vocabularies where single distributions are not, so positions no
aligned teacher position supervises still get a signal:

    loss = Σ_s w_s · ½ (ℓ_student(s) − ℓ_teacher(s))²

Both likelihoods are taken at temperature 1 (a likelihood of text, not a softened distribution). The
student's side runs through the fused hard-label kernel (`linear_cross_entropy`), never an [N, V]
tensor: once without gradients for the likelihoods, once with each token weighted by its span's
d loss / d ℓ. The teacher's side needs no gradient: its log-probabilities of its own next tokens,
chunk by chunk.

Legend: N student positions, M teacher positions, S spans, C tokens in a chunk, Vt the teacher's
vocabulary.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from mopd.store.format.transform import LogitTransform
from mopd.train.kernel.chunk_chain import chunk_size_for
from mopd.train.kernel.divergence import DivergenceOutput, linear_cross_entropy


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
        span_of: [N] the span of each position, −1 for none.
        teacher_likelihood: [S] each span's teacher log-likelihood (`teacher_log_probs`, summed).
        span_weights: [S] each span's weight (mask × normaliser).
        chunk_size, tp_group, vocab_start, vocab_size: as `linear_divergence`.

    Returns:
        DivergenceOutput(loss, per_token = [S] each span's ½ (ℓ_student − ℓ_teacher)², detached).
    """
    num_spans = teacher_likelihood.shape[0]
    if span_weights.shape != (num_spans,):
        raise ValueError(f"span_weights has shape {tuple(span_weights.shape)}, expected ({num_spans},)")
    if span_of.numel() and int(span_of.max()) >= num_spans:
        raise ValueError(f"a position names span {int(span_of.max())}; there are {num_spans}")
    common = {
        "chunk_size": chunk_size,
        "tp_group": tp_group,
        "vocab_start": vocab_start,
        "vocab_size": vocab_size,
    }
    in_span = torch.where(span_of >= 0, targets, -100)  # positions of no span contribute nothing
    with torch.no_grad():
        nll = linear_cross_entropy(
            student_hidden, student_head, in_span, weights=torch.ones(targets.shape), **common
        )
    gap_S = -span_sums(nll.per_token, span_of, num_spans) - teacher_likelihood.double()
    per_span = 0.5 * gap_S.square()
    # d loss / d log q(target_n) = w_s · gap_s for n in span s: the hard-label kernel's value is −log q,
    # so each token is weighted by −w_s · gap_s. Its loss has that gradient but not the span loss's
    # value, which is put in its place (value − value.detach() carries the gradient alone).
    slope_S = (span_weights.double() * gap_S).float()
    token_weights = torch.where(span_of >= 0, -slope_S[span_of.clamp(min=0)], 0.0)
    surrogate = linear_cross_entropy(student_hidden, student_head, in_span, weights=token_weights, **common)
    value = (span_weights.double() * per_span).sum().float()
    return DivergenceOutput(loss=surrogate.loss - surrogate.loss.detach() + value, per_token=per_span.float())
