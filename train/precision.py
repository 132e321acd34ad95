"""What pure bf16 training costs, measured on the run's own student at its own learning rate.

`train.dtype: bfloat16` keeps the weights and AdamW's moments in bf16. AdamW's first steps move every
weight by about the learning rate (m / √v is ±1 then); a weight w changes only if that step is at
least half a bf16 ulp of w (between 2⁻⁹|w| and 2⁻⁸|w|: bf16 keeps 8 significant bits), so at
distillation learning rates most weights do not move at all. `train.mixed_precision: bf16` computes
in bf16 over fp32 weights instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_SAMPLE = 1 << 16  # weights per parameter tensor looked at (its first ones: the share is a property of
# the weights' magnitudes, and every tensor's first elements are as typical as any)


@torch.no_grad()
def unchanged_share(parameters: Iterable[torch.Tensor], lr: float) -> float:
    """The share of the parameters' bf16 weights (this rank's parts of them) that one AdamW-sized step
    (`lr`, either sign) leaves unchanged."""
    weights = torch.cat([p.detach().reshape(-1)[:_SAMPLE] for p in parameters])
    w = weights.to(torch.bfloat16)
    up = (w.float() + lr).to(torch.bfloat16) == w
    down = (w.float() - lr).to(torch.bfloat16) == w
    return float((up & down).float().mean()) if w.numel() else 0.0


def pure_bf16_warning(share: float, lr: float) -> str:
    """The log line `train.dtype: bfloat16` gets."""
    return (
        f"warning: train.dtype bfloat16 keeps the weights and AdamW state in bf16: an AdamW step of "
        f"lr {lr:g} leaves {share:.0%} of this student's weights unchanged (below half a bf16 ulp), so "
        "they do not train; use dtype: float32 with mixed_precision: bf16 (bf16 compute, fp32 weights)"
    )
