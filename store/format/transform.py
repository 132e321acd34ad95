"""The logit post-transform of a teacher: logits = softcap · tanh(scale · h·Wᵀ / softcap) (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # tensors are only passed through: the metadata commands never import torch
    import torch


@dataclass(frozen=True)
class LogitTransform:
    """A logit scale (Cohere, Granite) and a final softcap (Gemma), either optional."""

    logit_scale: float | None = None
    final_logit_softcap: float | None = None

    @classmethod
    def from_model_config(cls, config: Any) -> LogitTransform:
        """The transform a transformers config declares (Gemma softcap, Cohere/Granite scale)."""
        scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
        granite = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
        if granite not in (None, 1, 1.0):
            scale = (scale or 1.0) / float(granite)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(
            logit_scale=None if scale in (None, 1, 1.0) else float(scale),
            final_logit_softcap=None if not softcap else float(softcap),
        )

    @property
    def is_identity(self) -> bool:
        return self.logit_scale is None and self.final_logit_softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcap is not None:
            logits = (logits / self.final_logit_softcap).tanh() * self.final_logit_softcap
        return logits

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """`apply`, in place (no temporary of the logits' size)."""
        if self.logit_scale is not None:
            logits.mul_(self.logit_scale)
        if self.final_logit_softcap is not None:
            logits.div_(self.final_logit_softcap).tanh_().mul_(self.final_logit_softcap)
        return logits
