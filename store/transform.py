"""The logit post-transform of a teacher: logits = softcap · tanh(scale · h·Wᵀ / softcap) (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """A logit scale (Cohere, Granite) and a final softcap (Gemma), either optional."""

    logit_scale: float | None = None
    final_logit_softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """`apply`, in place (no temporary of the logits' size)."""
        if self.logit_scale is not None:
            logits.mul_(self.logit_scale)
        if self.final_logit_softcap is not None:
            logits.div_(self.final_logit_softcap).tanh_().mul_(self.final_logit_softcap)
        return logits
