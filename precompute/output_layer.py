"""A transformers causal LM whose output layer's input is captured: the final hidden state mopd stores.

Every backend shares it. The `hf` backend runs the whole model on the teacher's device. The `vllm` and
`megatron` backends run the teacher in their own runtime, which never applies the output layer; they
take the LM head, the logit transform and the capture check from the checkpoint cut to its first block
(embeddings, one block, final norm and output layer: a small fraction of the teacher, on the CPU).

The capture is a forward pre-hook on `get_output_embeddings()`. After the capture the forward is
stopped, so the teacher's [tokens × vocab] logits are never computed — except once, on a probe batch, to
prove that `transform(capture · Wᵀ)` reproduces the model's own logits before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mopd.base.devices import resolve_device
from mopd.base.errors import ConfigError
from mopd.store.format.transform import LogitTransform


class _Captured(Exception):
    """Raised by the capture hook to stop the forward before the output layer runs."""


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`precompute.dtype` on `device`: auto is bfloat16 on a GPU, float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


class CapturedModel:
    """A loaded checkpoint that gives the input of its output layer, that layer and the capture proof."""

    def __init__(
        self,
        checkpoint: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        blocks: int | None = None,
    ) -> None:
        """Loads `checkpoint`; `blocks` keeps only its first transformer blocks."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self.checkpoint = checkpoint
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        overrides = {} if blocks is None else {"num_hidden_layers": blocks}
        verbosity = hf_logging.get_verbosity()
        if blocks is not None:  # the load report would list every left-out block's weights
            hf_logging.set_verbosity_error()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint,
                dtype=self.dtype,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,  # never a pickle (DESIGN §11)
                **overrides,
            )
        except (OSError, ValueError) as err:
            raise ConfigError(f"teacher {checkpoint}: cannot be loaded by transformers ({err})") from err
        finally:
            hf_logging.set_verbosity(verbosity)
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()
        head = self.model.get_output_embeddings()
        if head is None or getattr(head, "weight", None) is None:
            raise ConfigError(f"teacher {checkpoint}: the model has no output embedding layer to capture")
        self._head = head
        self.transform = LogitTransform.from_model_config(self.model.config)
        self.hidden_size = int(head.weight.shape[1])
        self.vocab_size = int(head.weight.shape[0])
        self._captured: torch.Tensor | None = None
        self._stop_after_capture = True
        head.register_forward_pre_hook(self._capture)

    def _capture(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self._captured = args[0]
        if self._stop_after_capture:
            raise _Captured

    def lm_head(self) -> torch.Tensor:
        """The output layer's weight [V, H] on the CPU, in the dtype the teacher computes in."""
        return self._head.weight.detach().to("cpu")

    def close(self) -> None:
        """Frees the model (the next teacher of the job loads after this one is closed)."""
        del self.model, self._head

    def forward(self, rows: Sequence[np.ndarray], *, full: bool) -> tuple[torch.Tensor, Any]:
        """The captured [B, L, H] states of right-padded `rows` (real tokens keep positions 0..L−1), and
        the model's output when `full` (else the forward stops at the capture: no logits)."""
        longest = max(len(r) for r in rows)
        input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
        attention = torch.zeros(len(rows), longest, dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
            attention[b, : len(row)] = 1
        self._stop_after_capture = not full
        output = None
        with torch.inference_mode(), contextlib.suppress(_Captured):
            output = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), use_cache=False
            )
        assert self._captured is not None
        captured, self._captured = self._captured, None
        return captured, output

    def check_capture(self, rows: Sequence[np.ndarray]) -> float:
        """Proves transform(capture · Wᵀ) equals the model's own logits on `rows`.

        Returns:
            The largest error relative to the largest logit magnitude.
        Raises:
            ConfigError: the logits are not expressible as transform(h · Wᵀ) (e.g. an output bias).
        """
        captured, output = self.forward(rows, full=True)
        weight = self._head.weight.float()
        worst = 0.0
        for b, row in enumerate(rows):
            own = output.logits[b, : len(row)].float()
            if not torch.isfinite(own).all():
                continue  # refused, naming the row, when its hidden states are written
            rebuilt = self.transform.apply(captured[b, : len(row)].float() @ weight.T)
            worst = max(worst, float((own - rebuilt).abs().max() / own.abs().max().clamp_min(1e-30)))
        # fp32: only summation order differs; bf16: the model's own GEMM rounds its output to bf16.
        tolerance = 1e-4 if self.dtype == torch.float32 else 2.0**-6
        if worst > tolerance:
            raise ConfigError(
                f"teacher {self.checkpoint}: logits are not transform(h · Wᵀ) of the output layer's input "
                f"(relative error {worst:.2e} > {tolerance:.0e} with transform {self.transform}); mopd "
                "supports a logit scale and a final softcap only (no output bias or other post-processing)"
            )
        return worst


def output_layer_only(checkpoint: str, *, dtype: torch.dtype, trust_remote_code: bool) -> CapturedModel:
    """The checkpoint cut to its first block, on the CPU: its output layer, logit transform and capture
    check, for backends whose own runtime does not apply the output layer (vllm, megatron)."""
    return CapturedModel(
        checkpoint,
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),
        trust_remote_code=trust_remote_code,
        blocks=1,
    )
