"""What bounds a training rank's memory: the estimate `mopd train` prints before step 1, and the one-line
error an allocation failure becomes.

The estimate adds what a rank holds through a step: its parameters, their gradients and AdamW's two
moments (16 bytes a parameter in fp32; the fsdp backend and ZeRO shard them), the teacher heads it keeps,
the activations the backward needs and the divergence kernel's chunk. Activations follow Korthikanti et
al. (2022), "Reducing Activation Recomputation in Large Transformer Models": about 17 values of the
hidden size per token and decoder layer (34·h bytes in 16-bit, attention scores left out as fused
attention keeps none); with activation checkpointing, one value per layer plus one whole layer. The
kernel holds a chunk's student and teacher logits and their gradient, three [chunk, vocabulary-shard]
fp32 buffers. It is an estimate: allocator caching, fragmentation and the framework's own buffers come
on top.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mopd.config.train import TrainConfig

ACTIVATION_VALUES_PER_LAYER = 17  # × hidden size, per token (Korthikanti et al., 34·h bytes at 2 bytes)
KERNEL_BUFFERS = 3  # a chunk's student logits, teacher logits and their gradient, fp32


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, int]  # bytes by what holds them

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self, device: torch.device) -> str:
        parts = ", ".join(f"{name} {in_units(size)}" for name, size in self.parts.items())
        total = in_units(self.total)
        return f"memory estimate per rank on {device}: {total} ({parts}), before the framework's own"


def in_units(size: float) -> str:
    """`1.5 GiB`, `12.3 MiB`: 3 significant digits."""
    return f"{size / 2**30:.3g} GiB" if size >= 2**30 else f"{size / 2**20:.3g} MiB"


def estimate_peak(
    parameters: list[torch.Tensor],
    *,
    tc: TrainConfig,
    hidden_size: int,
    layers: int,
    vocab_rows: int,
    chunk_size: int,
    heads_bytes: int,
    optimizer_shards: int = 1,
) -> MemoryEstimate:
    """The estimate of the module docstring for a rank holding `parameters` (its parts of them) and `layers`
    decoder layers of width `hidden_size`, whose loss spans `vocab_rows` of the vocabulary (0 on a
    pipeline stage without the loss); `optimizer_shards` ranks share its AdamW state (ZeRO)."""
    weights = sum(p.numel() * p.element_size() for p in parameters)
    compute_bytes = 2 if tc.mixed_precision == "bf16" or tc.dtype == "bfloat16" else 4
    tokens = tc.batch.micro_batch_tokens
    if tc.activation_checkpointing:
        values = tokens * hidden_size * (layers + ACTIVATION_VALUES_PER_LAYER)
    else:
        values = tokens * hidden_size * layers * ACTIVATION_VALUES_PER_LAYER
    return MemoryEstimate(
        {
            "weights": weights,
            "gradients": weights,
            "AdamW moments": 2 * weights // optimizer_shards,
            "teacher heads": heads_bytes,
            "activations": values * compute_bytes,
            "kernel": KERNEL_BUFFERS * min(chunk_size, tokens) * vocab_rows * 4 if vocab_rows else 0,
        }
    )


def allocation_failure(err: BaseException) -> str | None:
    """What failed to allocate, when `err` is an allocation failure (torch's CUDA or CPU allocator,
    Python's); None for any other error."""
    if isinstance(err, torch.OutOfMemoryError):
        return str(err).split(". ")[0]
    if isinstance(err, MemoryError):
        return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if isinstance(err, RuntimeError) and "can't allocate memory" in str(err):
        tried = re.search(r"tried to allocate (\d+) bytes", str(err))
        if tried is None:
            return "the CPU allocator failed"
        return f"the CPU allocator could not allocate {in_units(int(tried.group(1)))}"
    return None


def memory_settings(tc: TrainConfig, chunk_size: int) -> str:
    """The settings that bound a rank's memory, with their values."""
    chunk = f"{tc.divergence.chunk_size}" + (f" ({chunk_size})" if tc.divergence.chunk_size == "auto" else "")
    return (
        f"train.batch.micro_batch_tokens {tc.batch.micro_batch_tokens}, train.divergence.chunk_size {chunk}, "
        f"train.lm_head_lifecycle {tc.lm_head_lifecycle}, train.activation_checkpointing "
        f"{str(tc.activation_checkpointing).lower()}, train.mixed_precision {tc.mixed_precision}, "
        f"train.backend {tc.backend}, train.prefetch {tc.prefetch}"
    )
