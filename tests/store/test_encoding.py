"""The int8-rotated encoding's arithmetic: the rotation is orthogonal at every hidden size, it takes a
massive channel's cost away, the KL formula is exact where the naive one cancels, and the KL a token
costs obeys the error model (`store/codec/int8_rotated.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mopd.store.codec.int8_rotated import Encoding, draw_rotation, expected_kl, kl_bound, logit_divergence
from mopd.store.format.layout import factors

# fp32 rounding of a rotated value: each of the m + a + b products of a value's path adds at most one
# unit in the last place of a sum of unit-norm terms; 64 ulps of 1 covers every size below.
FP32_ROTATION = 64 * torch.finfo(torch.float32).eps


def encoding(hidden_size: int, mean: np.ndarray | None = None) -> Encoding:
    zero = np.zeros(hidden_size, np.float32)
    return Encoding.of(zero if mean is None else mean, *draw_rotation(hidden_size))


@pytest.mark.parametrize("hidden_size", [45, 48, 64, 96, 576, 896, 1024])
def test_the_rotation_is_orthogonal_and_undone(hidden_size: int) -> None:
    m, a, b = factors(hidden_size)
    assert m * a * b == hidden_size and m % 2 == 1 and a <= b <= 2 * a
    x = torch.randn(32, hidden_size)
    enc = encoding(hidden_size)
    y = enc.rotate(x)
    # Orthogonal: lengths and inner products kept; undone by its transpose.
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=FP32_ROTATION, atol=0)
    assert torch.allclose(enc.unrotate(y), x, rtol=0, atol=FP32_ROTATION * float(x.abs().max()))
    # Every channel is spread over all of them: a unit channel comes back with magnitude ~1/sqrt(H) in each.
    spread = enc.rotate(torch.eye(hidden_size)[:1]).abs()
    assert float(spread.max()) < 8 / hidden_size**0.5 and int((spread > 0).sum()) == hidden_size


def test_the_rotation_depends_on_the_seed_alone() -> None:
    first, second = draw_rotation(576, seed=7), draw_rotation(576, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert not np.array_equal(first[0], draw_rotation(576, seed=8)[0])


def massive_states(tokens: int, hidden_size: int, generator: torch.Generator) -> torch.Tensor:
    """States like a real teacher's final ones: a shared offset, and one channel 15x the others' RMS."""
    states = torch.randn(tokens, hidden_size, generator=generator) + 0.5
    states[:, 7] *= 15
    return states


def test_rotation_and_mean_take_the_massive_channels_cost_away() -> None:
    g = torch.Generator().manual_seed(0)
    states = massive_states(2048, 256, g)
    head = torch.randn(1000, 256, generator=g) / 16

    def mean_kl(enc: Encoding, rotate: bool) -> float:
        if rotate:
            decoded = enc.decode(*enc.encode(states))
        else:  # per-token absmax int8 of the states as they are
            scales = states.abs().amax(dim=1, keepdim=True) / 127
            decoded = torch.round(states / scales) * scales
        return float(logit_divergence(states @ head.T, (states - decoded) @ head.T)[0].mean())

    plain = mean_kl(encoding(256), rotate=False)
    rotated = mean_kl(encoding(256), rotate=True)
    centred = mean_kl(encoding(256, states.mean(dim=0).numpy()), rotate=True)
    # The int8 step is set by the largest value: 15 sigma unrotated, ~4 sigma (the maximum of 256 normal
    # draws) once rotated, and the KL goes with its square; the mean's offset widens every value's range.
    assert rotated < plain / 4
    assert centred < rotated


def test_the_kl_formula_is_exact_where_log_softmax_differences_cancel() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 5000, generator=g, dtype=torch.float64) * 4
    error = torch.randn(64, 5000, generator=g, dtype=torch.float64) * 1e-3
    kl, agree = logit_divergence(logits.float(), error.float())
    # The reference: the textbook sum in float64 from the float32 inputs. Each log-probability is off by
    # a few ulps of its magnitude (at most max|z| + log V), so the reference is within 8 such ulps.
    p_log = torch.log_softmax(logits.float().double(), dim=-1)
    q_log = torch.log_softmax(logits.float().double() - error.float().double(), dim=-1)
    reference = (p_log.exp() * (p_log - q_log)).sum(dim=-1)
    ulps = 8 * torch.finfo(torch.float64).eps * (float(logits.abs().max()) + np.log(logits.shape[1]))
    assert torch.allclose(kl, reference, rtol=0, atol=ulps)
    assert agree.all()
    # The same sum in float32 loses digits to cancellation: its error is far above the formula's.
    p32 = torch.log_softmax(logits.float(), dim=-1)
    naive = (p32.exp() * (p32 - torch.log_softmax(logits.float() - error.float(), dim=-1))).sum(dim=-1)
    assert float(((naive.double() - reference) / reference).abs().max()) > 1e-3


def test_each_tokens_kl_obeys_the_error_model() -> None:
    g = torch.Generator().manual_seed(2)
    states = massive_states(4096, 128, g)
    head = torch.randn(512, 128, generator=g) / 8
    enc = encoding(128, states.mean(dim=0).numpy())
    codes, scales = enc.encode(states)
    error = (states - enc.decode(codes, scales)) @ head.T
    kl, _ = logit_divergence(states @ head.T, error)
    # Hoeffding's lemma: whatever the rounding errors, KL ≤ H s² max‖w‖² / 8 on every token.
    assert bool((kl <= kl_bound(head, scales)).all())
    # In expectation over uniform rounding errors, KL = (s²/24) tr Cov_p(W) up to third-order terms. The
    # mean of 4,096 tokens sits within 4 standard errors of the model's, plus the third-order term
    # (relative size at most the largest logit error, under 0.1 here).
    model = expected_kl(torch.softmax((states @ head.T).double(), dim=-1), head, scales)
    standard_error = float((kl - model).std()) / len(kl) ** 0.5
    third_order = float(error.abs().max()) * float(model.mean())
    assert float(error.abs().max()) < 0.1
    assert abs(float(kl.mean()) - float(model.mean())) <= 4 * standard_error + third_order
