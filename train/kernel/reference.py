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
    logp_s, logp_t = zs.log_softmax(-1), zt.log_softmax(-1)
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
