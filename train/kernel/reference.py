"""The plain, unfused divergence: materialised logits and autograd. For tests and benchmarks only.

It holds [N, V] tensors for both sides (and autograd keeps several more), which is what the fused kernel
in `divergence.py` exists to avoid. Same arguments and semantics, single process, full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mopd.store.format.transform import LogitTransform
from mopd.train.kernel.divergence import DivergenceOutput


def reference_divergence(
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
    vocab_size: int | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
) -> DivergenceOutput:
    """Computes in float64 when the student inputs are float64, else float32."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    num_tokens = student_hidden.shape[0]
    vocab_size = student_head.shape[0] if vocab_size is None else vocab_size
    if teacher_index is None:
        teacher_index = torch.full((num_tokens,), next(iter(teacher_heads)), dtype=torch.long)
    zs = (student_hidden.to(dtype) @ student_head.to(dtype).T)[:, :vocab_size] / temperature
    zt = torch.empty_like(zs.detach())
    for t in teacher_index.unique().tolist():
        mask = teacher_index == t
        rows = teacher_hidden[t] if isinstance(teacher_hidden, Mapping) else teacher_hidden[mask]
        transform = (teacher_transforms or {}).get(t, LogitTransform())
        logits = transform.apply(rows.to(dtype) @ teacher_heads[t].to(dtype).T)
        zt[mask] = logits[:, :vocab_size] / temperature
    return _weighted(zs.log_softmax(-1), zt.log_softmax(-1), kind, beta, weights)


def reference_mixture(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    members: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    teacher_heads: Mapping[int, torch.Tensor],
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weights: torch.Tensor | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
) -> DivergenceOutput:
    """`ensemble.mixture_divergence` written out: every teacher's [N_t, V] distribution materialised,
    mixed as log Σ_k (w_k / Σ w) p_k. `members`: teacher → (positions, hidden rows, weights)."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    zs = (student_hidden.to(dtype) @ student_head.to(dtype).T) / temperature
    parts = torch.full((len(members), *zs.shape), float("-inf"), dtype=dtype)
    total = torch.zeros(zs.shape[0], dtype=dtype)
    for k, (t, (positions, hidden, weight)) in enumerate(members.items()):
        transform = (teacher_transforms or {}).get(t, LogitTransform())
        logits = transform.apply(hidden.to(dtype) @ teacher_heads[t].to(dtype).T) / temperature
        parts[k, positions] = logits.log_softmax(-1) + weight.to(dtype).log()[:, None]
        total[positions] += weight.to(dtype)
    logp_t = parts.logsumexp(0) - total.log()[:, None]
    return _weighted(zs.log_softmax(-1), logp_t, kind, beta, weights)


def _weighted(
    logp_s: torch.Tensor, logp_t: torch.Tensor, kind: str, beta: float, weights: torch.Tensor | None
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_s ‖ p_t) of the kind, from both sides' log-probabilities."""
    num_tokens, dtype = logp_s.shape[0], logp_s.dtype
    p_s, p_t = logp_s.exp(), logp_t.exp()
    if kind == "reverse_kl":
        value = (p_s * (logp_s - logp_t)).sum(-1)
    elif kind == "forward_kl":
        value = (p_t * (logp_t - logp_s)).sum(-1)
    elif kind == "cross_entropy":
        value = -(p_s * logp_t).sum(-1)
    elif kind == "entropy":
        value = -(p_s * logp_s).sum(-1)
    elif kind == "jsd":
        logm = (beta * p_t + (1 - beta) * p_s).log()
        value = beta * (p_t * (logp_t - logm)).sum(-1) + (1 - beta) * (p_s * (logp_s - logm)).sum(-1)
    elif kind == "tvd":
        value = 0.5 * (p_s - p_t).abs().sum(-1)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    weights = (
        torch.full((num_tokens,), 1.0 / num_tokens, dtype=dtype) if weights is None else weights.to(dtype)
    )
    return DivergenceOutput(loss=(weights * value).sum(), per_token=value.detach())
