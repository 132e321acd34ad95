"""The `hf` student: a transformers causal LM whose own output layer is bypassed.

`hidden_states` runs the backbone only (everything up to and including the final norm); the loss takes
those states and the output layer's weight (`head`) and calls the fused kernels, so the student's
[tokens × vocab] logits are never formed. Tied embeddings work unchanged: `head` is then the embedding
matrix, and its gradient gathers both uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mopd.store.errors import ConfigError
from mopd.store.fingerprint import vocab_hash
from mopd.store.manifest import Manifest
from mopd.store.transform import LogitTransform


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers without its per-file progress bars (the trainer prints its own lines)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


class HFStudent:
    """A transformers causal LM loaded from a local checkpoint folder, in `dtype`, on `device`."""

    def __init__(self, checkpoint: str | Path, *, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.checkpoint = Path(checkpoint)
        if not self.checkpoint.is_dir():
            raise ConfigError(f"train.student: {self.checkpoint} is not a checkpoint folder")
        with _quiet():
            self.model = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=dtype)
        torch.nn.Module.to(self.model, device)
        self.model.train()
        transform = LogitTransform.from_model_config(self.model.config)
        if not transform.is_identity:
            raise ConfigError(
                f"train.student: {self.checkpoint} post-processes its logits ({transform}); mopd trains "
                "students whose logits are hidden · headᵀ"
            )
        output = self.model.get_output_embeddings()
        if output is None or getattr(output, "bias", None) is not None:
            raise ConfigError(f"train.student: {self.checkpoint} has no bias-free linear output layer")
        self.backbone = self.model.base_model

    @property
    def head(self) -> torch.nn.Parameter:
        """[V, H] the output layer's weight (the embedding matrix when tied)."""
        return self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return int(self.head.shape[0])

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, H] final hidden states (after the last norm), the output layer's input."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def check_compatible(self, manifest: Manifest) -> None:
        """Refuses a student whose tokenizer or output vocabulary differs from the store's teachers."""
        tokenizer_file = self.checkpoint / "tokenizer.json"
        if tokenizer_file.exists() and vocab_hash(self.checkpoint) != manifest.tokenizer.vocab_hash:
            raise ConfigError(
                f"train.student: {self.checkpoint} has another tokenizer vocabulary than the store "
                f"({manifest.tokenizer.name}); student and teachers must share one vocabulary"
            )
        for teacher in manifest.teachers:
            if teacher.vocab_size > self.vocab_size:
                raise ConfigError(
                    f"train.student: its output layer has {self.vocab_size} rows, teacher {teacher.index} "
                    f"({teacher.checkpoint}) {teacher.vocab_size}; the student must cover the vocabulary"
                )

    def save(self, folder: Path) -> None:
        """A complete transformers checkpoint (config, safetensors weights, tokenizer files)."""
        with _quiet():
            self.model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
            source = self.checkpoint / name
            if source.exists():
                (folder / name).write_bytes(source.read_bytes())

    def load_weights(self, folder: Path) -> None:
        """Loads weights saved by `save` (bit-exact; resuming continues from exactly these values)."""
        from safetensors.torch import load_file

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{folder} holds no safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {name for name in missing if name.endswith("lm_head.weight")}
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"{folder}: weights do not fit the student (missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})"
            )
        if tied:
            self.model.tie_weights()
