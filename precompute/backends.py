"""What precompute needs of a teacher, whatever runs it, and the loader that picks the backend.

A backend is a class with the `TeacherModel` methods: `hf_backend` (transformers), `vllm_backend`
(vLLM's pooling runner) and `megatron_backend` (megatron-core, tensor and pipeline parallel). To add
one, write such a class (its LM head, transform and capture check can come from
`output_layer.output_layer_only`), add its name to `precompute.backend` and a branch to `load_teacher`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from mopd.base.errors import ConfigError
from mopd.config.precompute import PrecomputeConfig
from mopd.store.format.transform import LogitTransform


class HiddenStateSource(Protocol):
    """What a hidden-state task needs of a loaded teacher."""

    checkpoint: str
    hidden_size: int

    def hidden_states(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]: ...


class TeacherModel(HiddenStateSource, Protocol):
    """A loaded teacher of any backend: hidden states, its output layer and the proof that they agree."""

    transform: LogitTransform

    def lm_head(self) -> torch.Tensor: ...

    def check_capture(self, rows: Sequence[np.ndarray]) -> float: ...

    def close(self) -> None: ...


def load_teacher(
    settings: PrecomputeConfig,
    backend: str,
    checkpoint: str,
    *,
    max_model_len: int,
    group: Any = None,
    log: Callable[[str], Any] = print,
) -> TeacherModel:
    """Loads one teacher checkpoint with `backend` (vllm and megatron are imported only when asked for;
    `group` is the megatron backend's ModelParallelGroup; `log` hears which devices a vLLM engine spans)."""
    if backend == "hf":
        from mopd.precompute.hf_backend import HFTeacher

        return HFTeacher(
            checkpoint,
            device=settings.device,
            dtype=settings.dtype,
            trust_remote_code=settings.trust_remote_code,
        )
    if backend == "vllm":
        from mopd.precompute.vllm_backend import VLLMTeacher

        return VLLMTeacher(
            checkpoint,
            max_model_len=max_model_len,
            batch_tokens=settings.batch_tokens,
            device=settings.device,
            dtype=settings.dtype,
            trust_remote_code=settings.trust_remote_code,
            tp=settings.parallel.tp,
            pp=settings.parallel.pp,
            log=log,
        )
    if backend == "megatron":
        from mopd.precompute.megatron_backend import MegatronTeacher

        return MegatronTeacher(
            checkpoint, group=group, dtype=settings.dtype, trust_remote_code=settings.trust_remote_code
        )
    raise ConfigError(f"precompute.backend {backend!r} is not one of hf, vllm, megatron")
