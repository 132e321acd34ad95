"""The learning-rate schedule of a run, and the warnings its settings earn before it starts."""

from __future__ import annotations

import math

from mopd.config.train import BatchConfig


def lr_factor(step: int, *, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total` (`step` counts from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def schedule_warning(warmup: int, steps: int, lr: float) -> str | None:
    """A warning when warmup takes the whole run: the rate rises all the way, never decays."""
    if warmup < steps:
        return None
    reaches = (
        f"reaches train.optim.lr {lr:g} only at the last step"
        if warmup == steps
        else f"never reaches train.optim.lr {lr:g}"
    )
    return (
        f"warning: train.optim.warmup_steps {warmup} ≥ train.steps {steps}: the learning rate rises for the "
        f"whole run and {reaches}; "
        f"set warmup_steps below steps (e.g. train.optim.warmup_steps={max(1, steps // 10)})"
    )


def over_budget(batch: BatchConfig, longest: int) -> str | None:
    """One warning line when a batch budget is smaller than the store's longest row: such a row is a
    microbatch (or a step) of its own, over the budget, not cut or dropped."""
    small = [
        f"train.batch.{key} {budget}"
        for key, budget in (
            ("micro_batch_tokens", batch.micro_batch_tokens),
            ("global_batch_tokens", batch.global_batch_tokens),
        )
        if budget < longest
    ]
    if not small:
        return None
    return (
        f"warning: {' and '.join(small)} < the store's longest row ({longest} tokens): a row that long "
        "makes a microbatch (or step) of its own, over the budget"
    )
