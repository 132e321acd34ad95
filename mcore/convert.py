"""HF ↔ Megatron-core weight conversion for Llama-, Qwen2- and Qwen3-family causal LMs: only slicing,
concatenation and padding, so a round trip is bit-exact (the name map: docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mopd.base.errors import ConfigError

# What the conversion expresses exactly. Refused (use the hf backend): other families (Gemma's scaled
# embeddings and soft-capped logits, Phi's parallel blocks and LayerNorm, Mistral's and Qwen2's sliding
# windows, mixtures of experts), RoPE scaling (Llama 3.1's, YaRN), biases outside q/k/v, and activations
# other than SwiGLU.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class GPTShape:
    """What the conversion and the GPTModel need to know of an HF Llama/Qwen2-family config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    qk_norm: bool  # Qwen3's RMSNorm of each query and key head
    tied: bool
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config: Any) -> GPTShape:
        """Raises ConfigError for a model this conversion does not express exactly."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"the megatron backend converts {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints, not "
                f"{model_type!r}; use the hf backend for this model"
            )
        scaling = getattr(config, "rope_scaling", None) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ConfigError(
                f"the megatron backend does not convert RoPE scaling {scaling}; use the hf backend"
            )
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ConfigError("the megatron backend converts models without attention-output or MLP biases")
        if getattr(config, "use_sliding_window", False):
            raise ConfigError(
                "the megatron backend does not convert sliding-window attention; use the hf backend"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"the megatron backend converts SwiGLU models, not {config.hidden_act!r}")
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_query_groups=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=int(config.max_position_embeddings),
        )

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary padded so that every TP rank holds an equal, GEMM-friendly slice."""
        step = VOCAB_DIVISIBLE_BY * tp
        return -(-self.vocab_size // step) * step

    def check_tp(self, tp: int) -> None:
        if self.num_query_groups % tp or self.ffn_hidden_size % tp:
            raise ConfigError(
                f"tensor parallelism {tp} must divide the key/value heads ({self.num_query_groups}) and "
                f"the MLP width ({self.ffn_hidden_size})"
            )


def _split(tensor: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    return torch.chunk(tensor, size, dim=dim)[rank].clone()


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    padded = tensor.new_zeros(rows, *tensor.shape[1:])
    padded[: tensor.shape[0]] = tensor
    return padded


def _qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: GPTShape, rank: int, tp: int
) -> torch.Tensor:
    """[groups of this rank × (q heads per group + 2) × head_dim, ...] from HF q, k, v (weights or biases)."""
    per_group = shape.num_heads // shape.num_query_groups
    groups = shape.num_query_groups // tp
    d = shape.head_dim
    parts = []
    for g in range(rank * groups, (rank + 1) * groups):
        parts += [
            q[g * per_group * d : (g + 1) * per_group * d],
            k[g * d : (g + 1) * d],
            v[g * d : (g + 1) * d],
        ]
    return torch.cat(parts).clone()


def _unqkv(shards: list[torch.Tensor], shape: GPTShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = shape.num_heads // shape.num_query_groups
    d = shape.head_dim
    q, k, v = [], [], []
    for shard in shards:
        for group in torch.split(shard, (per_group + 2) * d):
            q.append(group[: per_group * d])
            k.append(group[per_group * d : (per_group + 1) * d])
            v.append(group[(per_group + 1) * d :])
    return torch.cat(q), torch.cat(k), torch.cat(v)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: GPTShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    first_layer: int = 0,
    num_layers: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> dict[str, torch.Tensor]:
    """This (TP rank, pipeline stage)'s Megatron state dict from an HF state dict."""
    shape.check_tp(tp_size)
    num_layers = shape.num_layers - first_layer if num_layers is None else num_layers
    vocab = shape.padded_vocab_size(tp_size)
    out: dict[str, torch.Tensor] = {}
    if pre_process or (post_process and shape.tied):
        embedding = _split(_pad_rows(hf["model.embed_tokens.weight"], vocab), tp_rank, tp_size)
        if pre_process:
            out["embedding.word_embeddings.weight"] = embedding
    for local in range(num_layers):
        src, dst = f"model.layers.{first_layer + local}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "self_attention.linear_qkv.weight"] = _qkv(
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
            shape,
            tp_rank,
            tp_size,
        )
        if shape.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"].clone()
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"].clone()
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _qkv(
                hf[attn + "q_proj.bias"],
                hf[attn + "k_proj.bias"],
                hf[attn + "v_proj.bias"],
                shape,
                tp_rank,
                tp_size,
            )
        out[dst + "self_attention.linear_proj.weight"] = _split(
            hf[attn + "o_proj.weight"], tp_rank, tp_size, 1
        )
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [
                _split(hf[src + "mlp.gate_proj.weight"], tp_rank, tp_size),
                _split(hf[src + "mlp.up_proj.weight"], tp_rank, tp_size),
            ]
        )
        out[dst + "mlp.linear_fc2.weight"] = _split(hf[src + "mlp.down_proj.weight"], tp_rank, tp_size, 1)
    if post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not shape.tied:
            out["output_layer.weight"] = _split(_pad_rows(hf["lm_head.weight"], vocab), tp_rank, tp_size)
        elif not pre_process:  # a tied head on a later stage than the embedding: Megatron keeps a copy
            out["output_layer.weight"] = embedding
    return out


def megatron_to_hf(
    stages: list[list[Mapping[str, torch.Tensor]]], shape: GPTShape, *, layers_per_stage: list[int]
) -> dict[str, torch.Tensor]:
    """The HF state dict from every stage's TP shards: `stages[pp_rank][tp_rank]`."""
    tp = len(stages[0])
    hf: dict[str, torch.Tensor] = {}

    def cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return torch.cat(parts, dim=dim).clone()

    first = stages[0]
    hf["model.embed_tokens.weight"] = cat([s["embedding.word_embeddings.weight"] for s in first])[
        : shape.vocab_size
    ]
    offset = 0
    for shards, count in zip(stages, layers_per_stage, strict=True):
        for local in range(count):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{offset + local}."
            attn = dst + "self_attn."
            hf[dst + "input_layernorm.weight"] = shards[0][src + "input_layernorm.weight"].clone()
            q, k, v = _unqkv([s[src + "self_attention.linear_qkv.weight"] for s in shards], shape)
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"] = q, k, v
            if shape.qk_norm:
                hf[attn + "q_norm.weight"] = shards[0][src + "self_attention.q_layernorm.weight"].clone()
                hf[attn + "k_norm.weight"] = shards[0][src + "self_attention.k_layernorm.weight"].clone()
            if shape.qkv_bias:
                q, k, v = _unqkv([s[src + "self_attention.linear_qkv.bias"] for s in shards], shape)
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"] = q, k, v
            hf[attn + "o_proj.weight"] = cat(
                [s[src + "self_attention.linear_proj.weight"] for s in shards], 1
            )
            hf[dst + "post_attention_layernorm.weight"] = shards[0][src + "pre_mlp_layernorm.weight"].clone()
            gates, ups = zip(*(torch.chunk(s[src + "mlp.linear_fc1.weight"], 2) for s in shards), strict=True)
            hf[dst + "mlp.gate_proj.weight"] = cat(list(gates))
            hf[dst + "mlp.up_proj.weight"] = cat(list(ups))
            hf[dst + "mlp.down_proj.weight"] = cat([s[src + "mlp.linear_fc2.weight"] for s in shards], 1)
        offset += count
    last = stages[-1]
    hf["model.norm.weight"] = last[0]["decoder.final_layernorm.weight"].clone()
    if not shape.tied:
        hf["lm_head.weight"] = cat([s["output_layer.weight"] for s in last])[: shape.vocab_size]
    assert tp == len(last)
    return hf
