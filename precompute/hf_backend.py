"""The `hf` teacher backend: the whole transformers causal LM on the teacher's device (CPU or GPU),
its forward stopped at the output layer's input (`output_layer.CapturedModel`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mopd.precompute.output_layer import CapturedModel


class HFTeacher(CapturedModel):
    """A loaded teacher that turns batches of token rows into final hidden states."""

    name = "hf"

    def hidden_states(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Final hidden states of each row, [L_i, H], on the CPU in the compute dtype; padding removed."""
        captured, _ = self.forward(rows, full=False)
        captured = captured.to("cpu")
        return [captured[b, : len(row)] for b, row in enumerate(rows)]
