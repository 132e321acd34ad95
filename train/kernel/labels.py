"""The hard-label loss −log p_s(label) through the fused chunk loop (`divergence.fused_loss`): the
optional CE term of training, and the student's side of the span loss (`spans.py`)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from mopd.train.kernel.chunk_chain import cached_compile, label_value_and_grad, shape_key
from mopd.train.kernel.divergence import (
    DivergenceOutput,
    _ChunkObjective,
    _full_width,
    _Plan,
    fused_loss,
    token_weights,
    valid_columns,
)


class _HardLabels(_ChunkObjective):
    """−log p_s(label): the label's logit is taken on the rank that owns it (labels of no rank: 0)."""

    def __init__(self, labels: torch.Tensor, vocab_start: int) -> None:
        self.labels, self.vocab_start = labels, vocab_start
        self.chain: Any = None  # the compiled chunk chain, when used

    def prepare(self, full: dict[str, torch.Tensor], plan: _Plan) -> None:
        zs = full["zs"]
        if plan.compiled and plan.group is None:
            local = torch.zeros(zs.shape[0], dtype=self.labels.dtype, device=zs.device)
            scale = zs.new_zeros(zs.shape[0])
            self.chain = cached_compile(
                label_value_and_grad, ("labels", *shape_key(zs)), [zs], zs, local, scale, None
            )

    def value_and_grad(
        self, full: dict[str, torch.Tensor], span: slice, scale_C: torch.Tensor, plan: _Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = span.stop - span.start
        local_C = self.labels[span] - self.vocab_start
        if self.chain is None:
            return label_value_and_grad(full["zs"][:size], local_C, scale_C, plan.group)
        # Full width, as `_SoftTargets` does; the spare rows' labels are owned by no rank.
        width = full["zs"].shape[0]
        padded = torch.cat([local_C, local_C.new_full((width - size,), -1)]) if size < width else local_C
        value, grad = self.chain(full["zs"], padded, _full_width(scale_C, full), None)
        return value[:size], grad[:size]


def linear_cross_entropy(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    labels: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | Literal["auto"] = "auto",
    tp_group: Any = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    compiled: bool = False,
) -> DivergenceOutput:
    """Σ_n weights_n · (−log p_s(labels_n)), the hard-label loss, without any [N, V] tensor.

    Args:
        student_hidden: [N, Hs]; student_head: [V_local, Hs] this rank's shard.
        labels: [N] global vocabulary ids; a negative label (e.g. −100) contributes zero.
        weights, temperature, chunk_size, tp_group, vocab_start, vocab_size, compiled: as
            `linear_divergence`.
    """
    num_tokens, local_vocab = student_hidden.shape[0], student_head.shape[0]
    if labels.shape != (num_tokens,):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected ({num_tokens},)")
    device = student_hidden.device
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    vocab_size = local_vocab * tp_size if vocab_size is None else vocab_size
    if labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"a label is ≥ the vocabulary size {vocab_size}")
    valid = valid_columns(vocab_start, local_vocab, vocab_size, device)
    weights = token_weights(weights, num_tokens, device)
    labels = labels.to(device)
    out = fused_loss(
        student_hidden,
        student_head,
        _HardLabels(torch.where(labels < 0, -(10**12), labels), int(vocab_start)),  # no rank's
        weights=torch.where(labels < 0, 0.0, weights.detach().float()),
        temperature=temperature,
        chunk_size=chunk_size,
        valid=valid,
        tp_group=tp_group,
        compiled=compiled,
    )
    return DivergenceOutput(loss=out.loss, per_token=torch.where(labels < 0, 0.0, out.per_token))
