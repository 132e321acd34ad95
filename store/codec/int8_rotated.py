"""The `int8-rotated` encoding of hidden states (`store.encoding`): 8 bits a value after a fixed rotation,
priced in nats by its error model (the derivation: docs/internals.md, store/codec/int8_rotated.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from mopd.store.format.layout import factors
from mopd.store.format.manifest import EncodingInfo
from mopd.store.format.transform import LogitTransform

SEED = 20261206  # the rotation's seed, recorded with each store's encoding
LEVELS = 127  # codes are symmetric: −127 … 127
# Tokens of the teacher's first task that fit the mean, and the part of them that measures the KL.
CALIBRATION_TOKENS = 8192
MEASURED_TOKENS = 2048


def _hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of order n (a power of two): symmetric and orthogonal."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix / math.sqrt(n)).float()


def draw_rotation(hidden_size: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """The random part of a rotation: signs [H] int8 and Q [m, m] float32, from `seed`."""
    m, _, _ = factors(hidden_size)
    rng = np.random.default_rng(seed)
    signs = (rng.integers(0, 2, hidden_size) * 2 - 1).astype(np.int8)
    q, r = np.linalg.qr(rng.standard_normal((m, m)))
    return signs, (q * np.sign(np.diag(r))).astype(np.float32)


@dataclass(frozen=True)
class Encoding:
    """One teacher's stored encoding: mean [H], signs [H] and Q [m, m] (the arrays of its task)."""

    mean: torch.Tensor  # float32
    signs: torch.Tensor  # float32, ±1
    mix: torch.Tensor  # float32 [m, m], orthogonal
    _on: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, mean: np.ndarray, signs: np.ndarray, mix: np.ndarray) -> Encoding:
        return cls(
            torch.from_numpy(np.asarray(mean, np.float32)),
            torch.from_numpy(np.asarray(signs, np.float32)),
            torch.from_numpy(np.asarray(mix, np.float32)),
        )

    @property
    def hidden_size(self) -> int:
        return int(self.mean.shape[0])

    def _parts(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(mean, signs, Q, H_a, H_b) on `device`, moved there once."""
        if device not in self._on:
            _, a, b = factors(self.hidden_size)
            parts = (self.mean, self.signs, self.mix, _hadamard(a), _hadamard(b))
            self._on[device] = tuple(part.to(device) for part in parts)
        return self._on[device]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x R for x [N, H] float32."""
        _, signs, mix, ha, hb = self._parts(x.device)
        m, a, b = factors(self.hidden_size)
        t = (x * signs).reshape(-1, m, a, b) @ hb
        t = (ha @ t).reshape(-1, m, a * b)
        return (mix.T @ t).reshape(-1, self.hidden_size)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """y Rᵀ for y [N, H] float32: the inverse of `rotate`."""
        _, signs, mix, ha, hb = self._parts(y.device)
        m, a, b = factors(self.hidden_size)
        t = (mix @ y.reshape(-1, m, a * b)).reshape(-1, m, a, b)
        t = (ha @ t) @ hb
        return t.reshape(-1, self.hidden_size) * signs

    def encode(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, H] int8, scales [N] float32) of hidden states [N, H] of any float dtype."""
        y = self.rotate(hidden.float() - self._parts(hidden.device)[0])
        scales = y.abs().amax(dim=1) / LEVELS
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(y / safe[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
        return codes, scales

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The hidden states [N, H] float32 that (codes, scales) stand for."""
        y = codes.float() * scales.float()[:, None]
        return self.unrotate(y) + self._parts(y.device)[0]


class Calibration:
    """A teacher's encoding, fitted on the states of its first rows (`add`, in row order): the mean of
    all of them, and the KL that the encoding costs measured on the first `MEASURED_TOKENS` (`fit`)."""

    def __init__(self) -> None:
        self.rows = 0
        self.tokens = 0
        self._sum: torch.Tensor | None = None
        self._kept: list[torch.Tensor] = []

    def add(self, states: list[torch.Tensor]) -> None:
        for row in states:
            row_sum = row.double().sum(dim=0)
            self._sum = row_sum if self._sum is None else self._sum + row_sum
            kept = sum(k.shape[0] for k in self._kept)
            if kept < MEASURED_TOKENS:
                self._kept.append(row[: MEASURED_TOKENS - kept].float())
            self.rows += 1
            self.tokens += row.shape[0]

    def fit(
        self, head: torch.Tensor, transform: LogitTransform, dtype: torch.dtype, seed: int = SEED
    ) -> tuple[Encoding, EncodingInfo]:
        """The encoding, and what it measured against the teacher's head [V, H] and logit transform, for
        decoded states rounded to `dtype` as readers get them."""
        if self._sum is None:
            raise ValueError("an encoding is fitted on at least one row")
        mean = (self._sum / self.tokens).float().cpu().numpy()
        encoding = Encoding.of(mean, *draw_rotation(mean.shape[0], seed))
        exact = torch.cat(self._kept)
        weight = head.to(exact.device, torch.float32)
        kl, agree = [], []
        for h in exact.split(256):
            error = (h - encoding.decode(*encoding.encode(h)).to(dtype).float()) @ weight.T
            token_kl, token_agree = logit_divergence(h @ weight.T, error, transform)
            kl.append(token_kl.cpu())
            agree.append(token_agree.cpu())
        kls = torch.cat(kl)
        info = EncodingInfo(
            seed=seed,
            calibration_rows=self.rows,
            calibration_tokens=self.tokens,
            measured_tokens=int(kls.shape[0]),
            kl_mean=float(kls.mean()),
            kl_p99=float(torch.quantile(kls, 0.99)),
            kl_max=float(kls.max()),
            top1_agreement=float(torch.cat(agree).double().mean()),
        )
        return encoding, info


def logit_divergence(
    exact: torch.Tensor, error: torch.Tensor, transform: LogitTransform | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p‖q) per token (float64) and whether the top-1 token agrees, where p's logits are
    T(`exact`) and q's are T(`exact` − `error`) (`error` = (h − ĥ)·Wᵀ, computed as its own product).

    Cancellation-free: with d = z_p − z_q and e = d − E_p[d], KL = log E_p[e^{−e}] = log1p(E_p[expm1(−e)]),
    so only the small difference enters the sums (log-softmax differences of fp32 logits lose ~6% at
    KLs of 1e-4).
    """
    a, err = exact.double(), error.double()
    transform = transform or LogitTransform()
    z_p = transform.apply(a)
    d = err if transform.is_identity else z_p - transform.apply(a - err)
    p = torch.softmax(z_p, dim=-1)
    e = d - (p * d).sum(dim=-1, keepdim=True)
    kl = torch.log1p((p * torch.expm1(-e)).sum(dim=-1)).clamp_min(0.0)
    agree = z_p.argmax(dim=-1) == (z_p - d).argmax(dim=-1)
    return kl, agree


def expected_kl(probs: torch.Tensor, head: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The error model's expected KL per token: (s²/24)·tr Cov_p(W), for p [N, V], W [V, H], s [N]."""
    p, w = probs.double(), head.double()
    second = p @ w.pow(2).sum(dim=1)  # E_p‖w‖²
    first = (p @ w).pow(2).sum(dim=1)  # ‖E_p w‖²
    return scales.double().pow(2) / 24 * (second - first)


def kl_bound(head: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hoeffding's bound on KL per token whatever the rounding errors: H·s²·max‖w_v‖²/8."""
    w = head.double()
    return w.shape[1] * scales.double().pow(2) * w.pow(2).sum(dim=1).max() / 8
