"""Random inputs for divergence tests: a student and up to three teachers of different hidden sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mopd.store.format.transform import LogitTransform


@dataclass
class Case:
    student_hidden: torch.Tensor  # [N, Hs]
    student_head: torch.Tensor  # [V, Hs]
    teacher_hidden: dict[int, torch.Tensor]  # teacher -> [N_t, H_t] in token order
    teacher_heads: dict[int, torch.Tensor]
    teacher_index: torch.Tensor  # [N]
    weights: torch.Tensor
    transforms: dict[int, LogitTransform] = field(default_factory=dict)

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Case:
        def conv(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).requires_grad_(t.requires_grad)

        return Case(
            conv(self.student_hidden),
            conv(self.student_head),
            {k: v.to(device=device, dtype=dtype) for k, v in self.teacher_hidden.items()},
            {k: v.to(device=device, dtype=dtype) for k, v in self.teacher_heads.items()},
            self.teacher_index,
            self.weights.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32),
            self.transforms,
        )


def make_case(
    *,
    num_tokens: int = 23,
    vocab: int = 97,
    student_size: int = 16,
    teachers: int = 1,
    softcap: bool = False,
    seed: int = 0,
    scale: float = 1.0,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    sizes = [24, 40, 24][:teachers]  # two of the three teachers differ in hidden size
    teacher_index = torch.randint(0, teachers, (num_tokens,), generator=g)
    teacher_index[:teachers] = torch.arange(teachers)  # every teacher present
    hidden = {
        t: torch.randn(int((teacher_index == t).sum()), sizes[t], generator=g) * scale
        for t in range(teachers)
    }
    heads = {t: torch.randn(vocab, sizes[t], generator=g) / sizes[t] ** 0.5 for t in range(teachers)}
    transforms = {0: LogitTransform(final_logit_softcap=2.5)} if softcap else {}
    weights = torch.rand(num_tokens, generator=g) * (torch.rand(num_tokens, generator=g) > 0.2)
    return Case(
        student_hidden=(torch.randn(num_tokens, student_size, generator=g) * scale).requires_grad_(),
        student_head=(torch.randn(vocab, student_size, generator=g) / student_size**0.5).requires_grad_(),
        teacher_hidden=hidden,
        teacher_heads=heads,
        teacher_index=teacher_index,
        weights=weights / weights.sum(),
        transforms=transforms,
    )


def logit_range(case: Case, temperature: float = 1.0) -> float:
    """The largest gap between two logits of one row, on either side, after transforms and temperature
    (the scale of a log-probability's rounding error; see tests/tolerance.value_atol)."""
    c = case.to(torch.float64)
    sides = [c.student_hidden.detach() @ c.student_head.detach().T]
    for t, rows in c.teacher_hidden.items():
        logits = rows @ c.teacher_heads[t].T
        sides.append(c.transforms[t].apply(logits) if t in c.transforms else logits)
    return max(float((z.amax(1) - z.amin(1)).max()) for z in sides if z.numel()) / temperature


def tvd_tie_atol(case: Case, eps: float, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise absolute bounds (grad_hidden [N, Hs], grad_head [V, Hs]) for what TVD's gradient may
    legitimately differ by between two computations of it.

    TVD's u = ½·sign(p_s − p_t) jumps where p_s = p_t: an entry with |p_s − p_t| ≤ eps·(p_s + p_t),
    within the probabilities' rounding error `eps`, may take either sign in a computation that is
    correct to that error. Flipping u at (n, v') by 1 moves d value_n / d z_s[n, v] by
    p_s[n, v]·(δ(v, v') + p_s[n, v']) (the gradient is p_s ⊙ (u − ⟨p_s, u⟩)); those moves, weighted
    and through the GEMMs' absolute values, bound the gradients' differences.
    """
    c = case.to(torch.float64)
    hs, ws = c.student_hidden.detach(), c.student_head.detach()
    zs = hs @ ws.T / temperature
    zt = torch.empty_like(zs)
    for t, rows in c.teacher_hidden.items():
        logits = rows @ c.teacher_heads[t].T
        transform = c.transforms.get(t)
        zt[c.teacher_index == t] = (transform.apply(logits) if transform else logits) / temperature
    ps, pt = zs.softmax(1), zt.softmax(1)
    tie = ((ps - pt).abs() <= eps * (ps + pt)).double()
    moved = ps * (tie + (tie * ps).sum(1, keepdim=True)) * (c.weights / temperature)[:, None]
    return moved @ ws.abs(), moved.T @ hs.abs()
