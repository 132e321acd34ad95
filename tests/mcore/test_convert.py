"""Acceptance: HF → Megatron → HF is bit-exact, and Megatron's forward gives the HF logits (TP 1 and 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from mopd.base.errors import ConfigError
from mopd.mcore.convert import GPTShape, hf_to_megatron, megatron_to_hf
from tests.distributed.harness import run_distributed
from tests.precompute.teachers import distinct_head_norms, make_tokenizer, model_config, save_teacher
from tests.tolerance import assert_close, network_rtol, perturbed

VOCAB = 400


def hf_model(arch: str, *, tied: bool = False, seed: int = 0, **extra: Any) -> Any:
    torch.manual_seed(seed)
    extra = {"num_key_value_heads": 4, **extra}
    config = model_config(arch, vocab_size=VOCAB, hidden_size=64, tie_word_embeddings=tied, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    distinct_head_norms(model)
    return model


def convert(state: dict[str, torch.Tensor], shape: GPTShape, tp: int, layers: list[int]) -> list[list[dict]]:
    stages = []
    for stage, count in enumerate(layers):
        first = sum(layers[:stage])
        stages.append(
            [
                hf_to_megatron(
                    state,
                    shape,
                    tp_rank=rank,
                    tp_size=tp,
                    first_layer=first,
                    num_layers=count,
                    pre_process=stage == 0,
                    post_process=stage == len(layers) - 1,
                )
                for rank in range(tp)
            ]
        )
    return stages


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("tp", "layers"), [(1, [2]), (2, [2]), (4, [2]), (2, [1, 1]), (1, [1, 1])])
def test_round_trip_is_bit_exact(arch: str, tied: bool, tp: int, layers: list[int]) -> None:
    model = hf_model(arch, tied=tied)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    shape = GPTShape.from_hf_config(model.config)
    stages = convert(state, shape, tp, layers)
    vocab = shape.padded_vocab_size(tp)
    assert vocab % (128 * tp) == 0 and vocab >= VOCAB
    first = stages[0][0]["embedding.word_embeddings.weight"]
    assert first.shape == (vocab // tp, 64)
    assert ("output_layer.weight" in stages[-1][0]) == (not tied or len(layers) > 1)
    back = megatron_to_hf(stages, shape, layers_per_stage=layers)
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_unsupported_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="converts llama, qwen2, qwen3 checkpoints, not 'gemma2'"):
        GPTShape.from_hf_config(hf_model("gemma2").config)
    with pytest.raises(ConfigError, match="sliding-window attention"):
        GPTShape.from_hf_config(hf_model("qwen3", use_sliding_window=True, sliding_window=16).config)
    with pytest.raises(ConfigError, match="without attention-output or MLP biases"):
        GPTShape.from_hf_config(hf_model("qwen3", attention_bias=True).config)
    with pytest.raises(ConfigError, match="RoPE scaling"):
        GPTShape.from_hf_config(
            hf_model(
                "llama", rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
            ).config
        )
    shape = GPTShape.from_hf_config(hf_model("llama", num_key_value_heads=2).config)
    with pytest.raises(ConfigError, match="tensor parallelism 4 must divide the key/value heads"):
        shape.check_tp(4)


def megatron_forward(
    rank: int, world: int, checkpoint: str, input_ids: torch.Tensor, sequence_parallel: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Worker: this TP rank's GPTModel from the converted checkpoint; (gathered logits, final hidden,
    final hidden of the rows without their last token: a length that tp does not divide)."""
    from megatron.core import parallel_state

    from mopd.mcore.cpu_compat import cpu_megatron, install_cpu_rng_tracker
    from mopd.mcore.model import gpt_model, load_state, stage_forward

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        install_cpu_rng_tracker()
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        shape = GPTShape.from_hf_config(hf.config)
        model = gpt_model(
            shape,
            tp=world,
            pp=1,
            dtype=torch.float32,
            pre_process=True,
            post_process=True,
            sequence_parallel=sequence_parallel,
        )
        load_state(model, hf_to_megatron(hf.state_dict(), shape, tp_rank=rank, tp_size=world))
        batch, length = input_ids.shape
        positions = torch.arange(length)[None].expand_as(input_ids)
        with torch.no_grad(), cpu_megatron():
            local = model.eval()(input_ids, positions, attention_mask=None)
            hidden = stage_forward(model, input_ids, batch=batch, length=length)
            shorter = stage_forward(model, input_ids[:, :-1], batch=batch, length=length - 1)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        logits = torch.cat(parts, dim=-1)[..., : shape.vocab_size]
        return logits, hidden.transpose(0, 1), shorter.transpose(0, 1)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mcore")
    tokenizer = make_tokenizer()
    return {
        arch: save_teacher(
            root / arch, arch, hidden_size=64, seed=seed, tokenizer=tokenizer, num_key_value_heads=2
        )
        for arch, seed in (("llama", 21), ("qwen2", 22), ("qwen3", 23))
    }


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("tp", "sequence_parallel"), [(1, False), (2, False), (2, True)])
def test_megatron_forward_equals_hf_logits(
    checkpoints: dict[str, Path], arch: str, tp: int, sequence_parallel: bool
) -> None:
    """Megatron logits and final hidden states equal HF's within 1e-5, also with the sequence split
    over the TP ranks (and padded where tp does not divide it)."""
    input_ids = torch.randint(0, len(make_tokenizer()), (2, 24), generator=torch.Generator().manual_seed(3))
    results = run_distributed(
        megatron_forward,
        world_size=tp,
        args=(str(checkpoints[arch]), input_ids, sequence_parallel),
        timeout=120,
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        if perturbed():  # one row at a time: other GEMM shapes, other blocking, other rounding
            rows = [model(ids[None], output_hidden_states=True) for ids in input_ids]
            logits = torch.cat([r.logits for r in rows])
            final = torch.cat([r.hidden_states[-1] for r in rows])
        else:
            expected = model(input_ids, output_hidden_states=True)
            logits, final = expected.logits, expected.hidden_states[-1]  # final: the output layer's input
    rtol = network_rtol(checkpoints[arch])  # one network, two implementations (and TP splits)
    for got_logits, hidden, shorter in results:
        assert_close(got_logits, logits, rtol=rtol, norm=True, what="logits")
        assert_close(hidden, final, rtol=rtol, norm=True, what="final hidden states")
        assert_close(shorter, final[:, :-1], rtol=rtol, norm=True, what="23-token final hidden states")
