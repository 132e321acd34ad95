"""A megatron-core student step through the pipeline schedules gives the HF student's loss, gradients and
gradient norm (TP2×PP2 on gloo; gradients mapped back to HF names by the weight conversion)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from mopd.mcore.convert import megatron_to_hf
from mopd.train.kernel.divergence import linear_divergence
from tests.distributed.harness import run_distributed
from tests.precompute.teachers import make_tokenizer, save_teacher
from tests.tolerance import assert_close, forward_rtol, perturbed

pytestmark = pytest.mark.distributed
TEACHER_HIDDEN = 48


@dataclass
class Micro:
    input_ids: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L] bool
    teacher_hidden: torch.Tensor  # [N, Ht], N = loss_mask.sum()


def microbatches(vocab: int) -> list[Micro]:
    """Three microbatches of different shapes, some positions untrained."""
    g = torch.Generator().manual_seed(5)
    out = []
    for batch, length in ((2, 12), (3, 7), (1, 16)):
        mask = torch.rand(batch, length, generator=g) < 0.8
        out.append(
            Micro(
                torch.randint(0, vocab, (batch, length), generator=g),
                mask,
                torch.randn(int(mask.sum()), TEACHER_HIDDEN, generator=g),
            )
        )
    return out


def reference(
    checkpoint: Path, mbs: list[Micro], teacher_head: torch.Tensor, vocab: int
) -> tuple[float, dict, float]:
    """The HF student's step over the first `vocab` rows of both heads (the tokens that exist)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).train()
    total = sum(int(mb.loss_mask.sum()) for mb in mbs)
    loss_sum = 0.0
    for mb in mbs:
        hidden = model.model(input_ids=mb.input_ids).last_hidden_state[mb.loss_mask]
        out = linear_divergence(
            hidden,
            model.lm_head.weight[:vocab],
            mb.teacher_hidden,
            {0: teacher_head[:vocab]},
            None,
            weights=torch.full((hidden.shape[0],), 1.0 / total),
            chunk_size=5 if perturbed() else 8,  # perturbed: other chunks, other order
        )
        out.loss.backward()
        loss_sum += float(out.loss.detach())
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss_sum, grads, float(torch.stack([g.double().pow(2).sum() for g in grads.values()]).sum().sqrt())


def megatron_step(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    checkpoint: str,
    mbs: list[Micro],
    teacher_head: torch.Tensor,
    vocab: int,
) -> tuple[float, dict | None, float]:
    from megatron.core import parallel_state

    from mopd.config.parallel import ParallelConfig
    from mopd.mcore.parallel import ModelParallelGroup
    from mopd.train.backends.megatron import MegatronStudent

    group = ModelParallelGroup.start(ParallelConfig(tp=tp, pp=pp), torch.device("cpu"), what="train.parallel")
    try:
        student = MegatronStudent(checkpoint, group=group, dtype=torch.float32)
        total = sum(int(mb.loss_mask.sum()) for mb in mbs)
        local = student.shape.padded_vocab_size(tp) // tp
        padded = torch.zeros(max(local * tp, teacher_head.shape[0]), TEACHER_HIDDEN)
        padded[: teacher_head.shape[0]] = teacher_head
        teacher_slice = padded[student.vocab_start : student.vocab_start + local]

        def loss_fn(hidden: torch.Tensor, head: torch.Tensor, mb: Micro) -> tuple[torch.Tensor, float]:
            out = linear_divergence(
                hidden,
                head,
                mb.teacher_hidden,
                {0: teacher_slice},
                None,
                weights=torch.full((hidden.shape[0],), 1.0 / total),
                chunk_size=8,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                vocab_start=student.vocab_start,
                vocab_size=vocab,
            )
            return out.loss, float(out.loss)

        mine = mbs[group.dp_rank :: group.dp_size]  # each data-parallel replica its own microbatches
        losses = student.forward_backward(mine, loss_fn)
        student.finish_gradients()
        norm = student.grad_norm()
        grads = {name: p.grad.clone() for name, p in student.model.named_parameters()}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (group.dp_rank, group.pp_rank, group.tp_rank, sum(losses), grads))
        if rank != 0:
            return 0.0, None, norm
        replica = sorted((e for e in everyone if e[0] == 0), key=lambda e: e[1:3])
        stages = [[e[4] for e in replica if e[1] == stage] for stage in range(pp)]
        loss = sum(e[3] for e in everyone if e[1] == pp - 1 and e[2] == 0)
        layers = [student.layers_per_stage] * pp
        return loss, megatron_to_hf(stages, student.shape, layers_per_stage=layers), norm
    finally:
        parallel_state.destroy_model_parallel()


def test_pipeline_step_equals_hf_step(tmp_path: Path) -> None:
    """TP2×PP2, untied. (The trainer's tests run TP2×PP2, TP2×DP2 and PP2×DP2 with a tied student for
    5 steps and compare losses; here one step's every gradient is compared.)"""
    tp, pp = 2, 2
    tokenizer = make_tokenizer()
    student = save_teacher(
        tmp_path / "student", "llama", hidden_size=64, seed=41, tokenizer=tokenizer, num_key_value_heads=2
    )
    vocab = len(tokenizer)
    mbs = microbatches(vocab)
    teacher_head = torch.randn(vocab, TEACHER_HIDDEN, generator=torch.Generator().manual_seed(6))
    expected_loss, expected, expected_norm = reference(student, mbs, teacher_head, vocab)
    results = run_distributed(
        megatron_step, world_size=tp * pp, args=(tp, pp, str(student), mbs, teacher_head, vocab), timeout=240
    )
    assert_same_step(results, expected_loss, expected, expected_norm)


def assert_same_step(results: list, expected_loss: float, expected: dict, expected_norm: float) -> None:
    loss, grads, _ = results[0]
    # One forward (the loss) and its backward (the gradients, the norm) of a 2-block student, 128 wide,
    # in two implementations: forward_rtol, twice for a backward's second pass.
    assert_close(loss, expected_loss, rtol=forward_rtol(2, 128), what="loss")
    norms = [norm for _, _, norm in results]
    assert_close(norms, [expected_norm] * len(results), rtol=2 * forward_rtol(2, 128), what="norm")
    assert grads is not None and sorted(grads) == sorted(expected)
    for name, grad in expected.items():
        assert_close(grads[name], grad, rtol=2 * forward_rtol(2, 128), norm=True, what=name)


def test_padded_vocabularies_at_tp2(tmp_path: Path) -> None:
    """A student of 288 output rows (Megatron pads them to 512 at TP=2) and a teacher head of 320 rows
    whose padding is large noise, over a tokenizer of 259 tokens: the step equals the HF student's over
    the first 259 rows of both heads, and the rows past them get no gradient."""
    tokenizer = make_tokenizer(vocab_size=259)
    vocab = len(tokenizer)
    student = save_teacher(
        tmp_path / "student",
        "qwen2",
        hidden_size=64,
        seed=42,
        tokenizer=tokenizer,
        num_key_value_heads=2,
        output_rows=288,
    )
    mbs = microbatches(vocab)
    g = torch.Generator().manual_seed(7)
    teacher_head = torch.cat(
        [
            torch.randn(vocab, TEACHER_HIDDEN, generator=g),
            8.0 * torch.randn(320 - vocab, TEACHER_HIDDEN, generator=g),
        ]
    )
    expected_loss, expected, expected_norm = reference(student, mbs, teacher_head, vocab)
    assert expected["lm_head.weight"][vocab:].abs().max() == 0
    results = run_distributed(
        megatron_step, world_size=2, args=(2, 1, str(student), mbs, teacher_head, vocab), timeout=240
    )
    assert_same_step(results, expected_loss, expected, expected_norm)
