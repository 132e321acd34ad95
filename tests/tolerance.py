"""Numeric comparisons of the suite, each against a bound derived from the arithmetic it checks.

Every floating-point comparison goes through `assert_close`; its bound comes from one of the error
models below (or, with `rigorous=True`, from a worst case that holds by proof), and the caller says in a
comment which quantities enter it. The models, in fp32's unit roundoff U = 2⁻²⁴:

- `sum_rtol(n)`: a sum of n rounded terms, worst case n·U relative to the sum of their magnitudes
  (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1).
- `forward_rtol(layers, width)`: a network's output computed two ways (another kernel, split, batch or
  order). Each of a layer's 7 matrix products (q, k, v, o, gate, up, down) accumulates ≤ width terms;
  rounding errors of independent roundings add like a random walk, λ√n·U for n roundings except with
  probability ≤ 2·exp(−λ²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm 2.4). λ = 6 makes
  that ≤ 3e-8 per accumulation; over all layers: λ·√(7·layers·width)·U.
- `trajectory_rtol(steps, …)`: the same run trained `steps` optimiser steps two ways: every step's
  forward and backward (2×) leave rounding differences in the weights that later steps inherit, so the
  errors of k steps add (≤ k × one step's). This bounds one token's value and a gradient norm; a mean
  over N trained tokens of independent per-token errors is √N times tighter (`mean_over`).
- `value_atol(vocab, logit_range)`: one token's divergence (any of the six kinds) computed in fp32:
  its log-probabilities pass through a log-sum-exp over the vocabulary (pairwise: ⌈log₂ V⌉ roundings,
  plus exp, log and a subtraction), each relative to the largest logit gap; the value sums p·(log p_s −
  log p_t) over the same vocabulary with as many roundings again.

Another machine rounds differently: another CPU's BLAS picks other kernels and reduction orders, and
another thread count splits reductions elsewhere. `scripts/tolerance-audit` runs the numeric tests under
such perturbations with `MOPD_TOLERANCE_LOG` set, so that every comparison records its largest error as
a fraction of its bound, and reports the worst fraction per comparison; each must stay ≤ 1/3.
`perturbed()` tells a test that compares two runs to change the reference run's order of operations
(chunk sizes, microbatch budgets) without changing its arithmetic.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

U = 2.0**-24  # fp32 unit roundoff: |fl(x) − x| ≤ U·|x| for one rounding
BF16_U = 2.0**-8  # bf16 keeps 8 significant bits
LAMBDA = 6.0  # probabilistic rounding bound's confidence (see forward_rtol)
MATMULS_PER_LAYER = 7


def sum_rtol(terms: int) -> float:
    """Worst case of a sum of `terms` rounded terms, relative to the sum of their magnitudes."""
    return terms * U


def forward_rtol(layers: int, width: int) -> float:
    """A `layers`-deep network whose longest accumulation is `width` terms, computed two ways."""
    return LAMBDA * math.sqrt(MATMULS_PER_LAYER * layers * width) * U


def network_rtol(checkpoint: str | os.PathLike[str]) -> float:
    """`forward_rtol` of a transformers checkpoint: its depth, and its widest accumulation (the MLP's
    inner size, the hidden size, or the longest sequence the tests run: 128)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    config = config.get("text_config", config)
    width = max(config["hidden_size"], config.get("intermediate_size") or 0, 128)
    return forward_rtol(config["num_hidden_layers"], width)


def trajectory_rtol(steps: int, layers: int, width: int) -> float:
    """One token's value (or a gradient norm) after `steps` optimiser steps computed two ways."""
    return steps * 2 * forward_rtol(layers, width)


def bf16_trajectory_rtol(steps: int, layers: int) -> float:
    """One token's value (or a gradient norm) after `steps` steps of bf16 compute against the same run
    in fp32. Each of a layer's 7 products rounds its two operands and its output to bf16 (it accumulates
    in fp32, whose roundings are 2⁸ times smaller), 3·7·layers roundings of ≤ BF16_U adding like a
    random walk (as in `forward_rtol`); the backward as many again (2×); k steps' differences add (as in
    `trajectory_rtol`)."""
    return steps * 2 * LAMBDA * math.sqrt(3 * MATMULS_PER_LAYER * layers) * BF16_U


def mean_over(tokens: int, rtol: float) -> float:
    """A mean over `tokens` independent per-token errors of `rtol` each."""
    return rtol / math.sqrt(tokens)


def value_atol(vocab: int, logit_range: float) -> float:
    """Absolute error of one token's divergence in fp32, computed two ways (both within it: ×2).

    Args:
        vocab: the vocabulary the softmax sums over.
        logit_range: the largest gap between a row's logits (after temperature) on either side.
    """
    roundings = math.ceil(math.log2(vocab)) + 3
    return 2 * 2 * roundings * U * (1.0 + logit_range)


LOG_VARIABLE = "MOPD_TOLERANCE_LOG"
PERTURB_VARIABLE = "MOPD_TEST_PERTURB"


def perturbed() -> bool:
    """True when the audit asks compared runs to take their reductions in another order."""
    return os.environ.get(PERTURB_VARIABLE) == "1"


def _as_float64(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def error_fraction(
    got: Any, want: Any, *, rtol: float = 0.0, atol: float | torch.Tensor = 0.0, norm: bool = False
) -> float:
    """The largest error as a fraction of the allowed one (≤ 1 passes; 0 when both are exactly equal).

    Elementwise: max over elements of |got − want| / (atol + rtol·|want|). Normwise (`norm=True`):
    max|got − want| / (atol + rtol·max|want|), for outputs whose small elements carry the absolute
    rounding error of the large ones (a logit row, a gradient matrix).
    """
    g, w = _as_float64(got), _as_float64(want)
    if g.shape != w.shape:
        raise AssertionError(f"shapes differ: got {tuple(g.shape)}, want {tuple(w.shape)}")
    if g.numel() == 0:
        return 0.0
    diff = (g - w).abs()
    allowed = (atol + rtol * (w.abs().max() if norm else w.abs())).expand_as(diff)
    return float(torch.where(diff == 0, 0.0, diff / allowed).max())


def assert_close(
    got: Any,
    want: Any,
    *,
    rtol: float = 0.0,
    atol: float | torch.Tensor = 0.0,
    norm: bool = False,
    rigorous: bool = False,
    what: str = "",
) -> None:
    """Asserts `got` is within the bound of `want` (see `error_fraction`) and records the fraction.

    `rigorous`: the bound is a proven worst case (e.g. one rounding to bf16), which no machine can
    exceed; the audit's margin rule, meant for estimated bounds, does not apply to it.
    """
    fraction = error_fraction(got, want, rtol=rtol, atol=atol, norm=norm)
    log = os.environ.get(LOG_VARIABLE)
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        line = {"test": test, "what": what, "fraction": fraction, "rigorous": rigorous}
        with open(log, "a") as out:
            out.write(json.dumps(line) + "\n")
    if not fraction <= 1.0:
        g, w = _as_float64(got), _as_float64(want)
        raise AssertionError(
            f"{what or 'values'}: max |got − want| = {float((g - w).abs().max()):.3e} is {fraction:.2f}x "
            f"the bound (rtol {rtol:.3e}, {'normwise' if norm else 'elementwise'})"
        )


# Step statistics of metrics.jsonl: one token's value, a norm, or a mean over the step's trained tokens.
PER_TOKEN_KEYS = ("divergence_min", "divergence_max", "grad_norm")
MEAN_KEYS = ("loss", "divergence")


def assert_same_training(
    got: list[dict[str, Any]], want: list[dict[str, Any]], *, layers: int, width: int, since: int = 0
) -> None:
    """Two runs of the same training (another layout, split or order) agree step by step.

    Step k's statistics carry k − `since` steps of diverging rounding (`trajectory_rtol`): a single
    token's extreme value and the gradient norm the whole of it, a mean over the step's N trained tokens
    (`mean_over`) √N times less.
    """
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for mine, theirs in zip(got, want, strict=True):
        rtol = trajectory_rtol(mine["step"] - since, layers, width)
        for key in PER_TOKEN_KEYS:
            assert_close(mine[key], theirs[key], rtol=rtol, what=f"step {mine['step']} {key}")
        for key in MEAN_KEYS:
            mean = mean_over(theirs["trained_tokens"], rtol)
            assert_close(mine[key], theirs[key], rtol=mean, what=f"step {mine['step']} {key}")


TIMING_KEYS = ("tokens_per_s", "data_wait", "step_seconds", "memory_gib")  # of the machine, not the run


def learned(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each step computed: every field of its record but the timing and memory ones (for runs that
    must agree bit for bit)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]
