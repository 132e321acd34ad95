"""Megatron-core GPTModel for an HF Llama/Qwen2/Qwen3-family checkpoint (local spec: no Transformer
Engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mopd.base.errors import ConfigError
from mopd.mcore.convert import GPTShape, hf_to_megatron
from mopd.mcore.cpu_compat import megatron_device
from mopd.mcore.parallel import ModelParallelGroup


def transformer_config(
    shape: GPTShape,
    *,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    sequence_parallel: bool = False,
    recompute: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Any:
    """The TransformerConfig that computes what the HF model computes (no dropout, no fused kernels);
    with `recompute`, each layer keeps only its input and recomputes the rest in the backward;
    `compute_dtype`: what the stages send each other when they compute in another dtype than their
    weights' (under autocast)."""
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        # Qwen3's per-head query/key norms; finalize_model_grads sums their gradients over the tensor-
        # parallel ranks (each normalises its own heads with the same weight).
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=compute_dtype or dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # The pipeline schedules take losses normalised by the caller (by the global trained-token
        # count) instead of averaging them per microbatch.
        calculate_per_token_loss=True,
        **(
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            if recompute
            else {}
        ),
    )
    # Microbatches of their own length and batch size, their shapes sent between stages. (Set after
    # construction: the constructor's check for MoE token dispatchers does not apply to dense models.)
    config.variable_seq_lengths = True
    return config


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron-core builds its norms, for the local layer spec.

    Unlike megatron-core's own torch wrapper, it allows sequence parallelism. There each tensor-parallel
    rank normalises only its share of the sequence, so the weight's gradient on a rank is partial: the
    weight is marked `sequence_parallel`, and the student sums those gradients over the tensor-parallel
    ranks (`MegatronStudent.finish_gradients`).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def block_spec(num_layers: int, *, qk_norm: bool = False) -> Any:
    """One pipeline stage's decoder: `num_layers` layers of megatron-core's local spec, norms `RMSNorm`
    (with `qk_norm`, also each attention head's query and key)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    attention = layer.submodules.self_attention
    if qk_norm:
        heads = dataclasses.replace(attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
        attention = dataclasses.replace(attention, submodules=heads)
    norms = dataclasses.replace(
        layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attention
    )
    return TransformerBlockSubmodules(
        layer_specs=[dataclasses.replace(layer, submodules=norms)] * num_layers, layer_norm=RMSNorm
    )


def gpt_model(
    shape: GPTShape,
    *,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    sequence_parallel: bool = False,
    recompute: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Any:
    """This rank's GPTModel (its pipeline stage, its tensor-parallel shards), weights uninitialised."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        shape,
        tp=tp,
        pp=pp,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        compute_dtype=compute_dtype,
    )
    return GPTModel(
        config,
        block_spec(shape.num_layers // pp, qk_norm=shape.qk_norm),
        vocab_size=shape.padded_vocab_size(tp),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tied,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads a converted state dict; every parameter must be given and nothing else (Megatron's
    `_extra_state` entries, empty for these modules, aside)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"converted weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )


def computed_length(config: Any, length: int) -> int:
    """The sequence length the stages compute: under sequence parallelism, padded to a multiple of tp
    (at the end, where causal attention keeps the real tokens exact)."""
    if not config.sequence_parallel:
        return length
    tp = config.tensor_model_parallel_size
    return -(-length // tp) * tp


def activation_shape(config: Any, *, batch: int, length: int) -> tuple[int, int, int]:
    """[L, B, H] of what one pipeline stage sends the next: the whole sequence, or under sequence
    parallelism this rank's 1/tp share of it."""
    shares = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return computed_length(config, length) // shares, batch, config.hidden_size


def stage_forward(model: Any, input_ids: torch.Tensor | None, *, batch: int, length: int) -> torch.Tensor:
    """[length, batch, H] this pipeline stage's output, the model's output layer bypassed.

    The first stage embeds `input_ids`; later stages take their input from `model.set_input_tensor`
    (shaped as `activation_shape` says). On the last stage the result is the final norm's output: the
    input of the output layer, which mopd applies itself (chunked, inside the divergence kernels or when
    writing the store). Under sequence parallelism the last stage gathers the ranks' shares of the
    sequence and drops the padding; the gather's backward keeps this rank's share of the gradient as it
    is, since the vocabulary-parallel divergence kernels already sum it over the tensor-parallel ranks.
    """
    computed = computed_length(model.config, length)
    decoder_input = None
    if model.pre_process:
        assert input_ids is not None
        padded = F.pad(input_ids, (0, computed - length))
        positions = torch.arange(computed, device=input_ids.device)[None].expand(batch, computed)
        decoder_input = model.embedding(input_ids=padded, position_ids=positions)
    output = model.decoder(
        hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(computed)
    )
    if model.post_process and model.config.sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)[:length]
    return output


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """An HF checkpoint's tensors by name, each read from its safetensors file when asked for, in `dtype`.

    A rank converts only its stage's layers, so it reads only those (and slices them for its TP rank),
    never the whole checkpoint.
    """

    def __init__(self, folder: Path, dtype: torch.dtype, *, what: str) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        self._files = [safe_open(str(f), framework="pt") for f in sorted(folder.glob("*.safetensors"))]
        if not self._files:
            raise ConfigError(
                f"{what}: {folder} holds no safetensors weights (the megatron backend reads those)"
            )
        # safe_open handles are not iterable: their names come from keys()
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_stage(
    checkpoint: str | Path,
    group: ModelParallelGroup,
    dtype: torch.dtype,
    *,
    what: str,
    recompute: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Any, GPTShape]:
    """(this rank's GPTModel stage with its converted weights on its device, the model's shape).

    `what` names the model in errors (`teacher ckpt/x`, `train.student`); `recompute`: activation
    checkpointing of every layer; `compute_dtype`: the dtype of the stages' activations under autocast.

    Raises:
        ConfigError: not a convertible Llama/Qwen2 checkpoint, no safetensors weights, or a layout that
            does not divide its heads, MLP width or layers.
    """
    from transformers import AutoConfig

    if group.device.type == "cpu":
        from mopd.mcore.cpu_compat import install_cpu_rng_tracker

        install_cpu_rng_tracker()
    shape = GPTShape.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    shape.check_tp(group.tp)
    if shape.num_layers % group.pp:
        raise ConfigError(
            f"{what}: pipeline parallelism {group.pp} must divide its {shape.num_layers} layers"
        )
    per_stage = shape.num_layers // group.pp
    state = hf_to_megatron(
        SafetensorsCheckpoint(Path(checkpoint), dtype, what=what),
        shape,
        tp_rank=group.tp_rank,
        tp_size=group.tp,
        first_layer=group.pp_rank * per_stage,
        num_layers=per_stage,
        pre_process=group.is_first_stage,
        post_process=group.is_last_stage,
    )
    with megatron_device(group.device):  # a tied head on a later stage copies the embedding in here
        model = gpt_model(
            shape,
            tp=group.tp,
            pp=group.pp,
            dtype=dtype,
            pre_process=group.is_first_stage,
            post_process=group.is_last_stage,
            sequence_parallel=group.sequence_parallel,
            recompute=recompute,
            compute_dtype=compute_dtype,
        )
    load_state(model, state)
    return model.to(group.device), shape


def release_checkpoint_writer() -> None:
    """Ends the process megatron-core's checkpoint writer keeps after a save.

    Its `FileSystemWriterAsync` collects the writers' results through a multiprocessing manager — a
    process of its own, ~270 MB — made at the first save and kept in a module global for the rest of the
    process (megatron-core 0.16). A rank killed later (a fault, the OOM killer) would leave it running,
    and a long-lived process (`mopd rounds`) keeps it idle; the next save makes a new one.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue
    if results is not None:
        filesystem_async._results_queue = None
        results._manager.shutdown()
