"""The per-chunk math of the fused losses: from one chunk's tempered logits to each token's value and
its gradient with respect to the student logits, eager or as one compiled function.

Legend as in `divergence.py`: C tokens in a chunk, V this rank's vocabulary slice. Every kind's
gradient has the form p_s ⊙ (u − ⟨p_s, u⟩), with u = ∂value/∂p_s (forward KL is written directly as
p_s − p_t); softmax statistics are reduced over the tensor-parallel group with O(C) numbers a chunk.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


NEEDS_P_T = ("forward_kl", "jsd", "tvd")


def _scaled_gradient(
    u: torch.Tensor, value: torch.Tensor, p_s: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """scale ⊙ p_s ⊙ (u − value) into `out`, through `u`."""
    return torch.mul(u.sub_(value[:, None]).mul_(p_s), scale[:, None], out=out)


def _shift_by_max(zs: torch.Tensor, zt: torch.Tensor, group: Any) -> torch.Tensor:
    """Each row of both sides less its (tensor-parallel global) max, in place; the maxes [C, 2]."""
    maxes = all_reduce(torch.stack([zs.amax(1), zt.amax(1)], 1), dist.ReduceOp.MAX, group)
    zs.sub_(maxes[:, :1])
    zt.sub_(maxes[:, 1:])
    return maxes


def _reverse_kl(
    zs: torch.Tensor,
    zt: torch.Tensor,
    scratch: torch.Tensor,
    valid_V: torch.Tensor | None,
    scale_C: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse KL, the default kind, in 12 passes over [C, V], 2 of them exps.

    With e_s = exp(z_s − m_s), Σ_s its row sum, w = (z_s − m_s) − (z_t − m_t) and Δ = log Σ_s − log Σ_t:
    log p_s − log p_t = w − Δ, so KL = ⟨e_s, w⟩ / Σ_s − Δ, and its gradient p_s ⊙ (u − KL) is
    (e_s ⊙ w − ⟨w⟩ e_s) / Σ_s with ⟨w⟩ = ⟨e_s, w⟩ / Σ_s. Neither p_s nor the log-probabilities are
    formed, and one collective carries the three row sums.
    """
    _shift_by_max(zs, zt, group)
    sum_t = torch.exp(zt, out=scratch).sum(1)
    w = torch.sub(zs, zt, out=zt)
    if valid_V is not None:  # padded columns: −inf − −inf; e_s = 0 there, so w = 0 gives 0 · w = 0
        w.masked_fill_(~valid_V, 0.0)
    e_s = zs.exp_()
    sum_s = e_s.sum(1)
    e_w = w.mul_(e_s)
    sums = all_reduce(torch.stack([sum_s, sum_t, e_w.sum(1)], 1), dist.ReduceOp.SUM, group)
    mean_w = sums[:, 2] / sums[:, 0]
    value = mean_w - (sums[:, 0].log() - sums[:, 1].log())
    return value, torch.mul(e_w.addcmul_(e_s, -mean_w[:, None]), (scale_C / sums[:, 0])[:, None], out=zs)


def soft_value_and_grad(
    buffers: dict[str, torch.Tensor],
    valid_V: torch.Tensor | None,
    kind: str,
    beta: float,
    scale_C: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value [C] and scale_C ⊙ d value / d z_s [C, V] from tempered logits, in place: the
    gradient takes the place of `zs`.

    `zs` and `zt` hold the tempered logits (masked columns −inf: `valid_V` [V] the columns of every
    token, or [C, V] each token's own) and become log p_s and log p_t, then
    scratch; `ps` holds p_s. Reverse KL, cross-entropy and entropy need nothing more: 3 buffers of
    [C, V]. Forward KL adds `pt`; JSD and TVD add `work` and a few temporaries. Each side's exp is taken
    once (the probabilities are the exps over their sum, not exps of the log-probabilities), which is
    most of the chain's time on a CPU. Row sums use torch's pairwise reduction (a running dot product
    loses the 1e-6 agreement of KL = CE − H near values of 5).
    """
    zs, zt, ps = buffers["zs"], buffers["zt"], buffers["ps"]
    if kind == "reverse_kl":
        return _reverse_kl(zs, zt, ps, valid_V, scale_C, group)
    pt = buffers["pt"] if kind in NEEDS_P_T else None
    maxes = _shift_by_max(zs, zt, group)
    sum_t = torch.exp(zt, out=ps if pt is None else pt).sum(1)  # ps is only scratch here
    sum_s = torch.exp(zs, out=ps).sum(1)
    sums = all_reduce(torch.stack([sum_s, sum_t], 1), dist.ReduceOp.SUM, group)
    log_sums = sums.log()
    p_s = ps.div_(sums[:, :1])
    p_t = pt.div_(sums[:, 1:]) if pt is not None else None

    logp_s = zs.sub_(log_sums[:, :1])
    logp_t = zt.sub_(log_sums[:, 1:])
    if valid_V is not None:  # padded columns: p = 0; make log p finite so that 0 · log p = 0
        logp_s.masked_fill_(~valid_V, 0.0)
        logp_t.masked_fill_(~valid_V, 0.0)
    if kind in ("cross_entropy", "entropy"):
        # u = ∂value/∂p_s overwrites one log-prob buffer; the product for the row sum uses the other.
        u, spare = (logp_t.neg_(), logp_s) if kind == "cross_entropy" else (logp_s.neg_(), logp_t)
        value = all_reduce(torch.mul(p_s, u, out=spare).sum(1), dist.ReduceOp.SUM, group)
        return value, _scaled_gradient(u, value, p_s, scale_C, out=zs)
    assert p_t is not None
    if kind == "forward_kl":
        value = all_reduce(logp_t.sub_(logp_s).mul_(p_t).sum(1), dist.ReduceOp.SUM, group)
        return value, torch.sub(p_s, p_t, out=logp_s).mul_(scale_C[:, None])
    work = buffers["work"]
    if kind == "jsd" and beta in (0.0, 1.0):  # m equals one side: both terms vanish
        return torch.zeros_like(maxes[:, 0]), zs.zero_()
    if kind == "jsd":
        logm = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log(1 - beta))
        terms = beta * p_t * (logp_t - logm) + (1 - beta) * p_s * (logp_s - logm)
        u = torch.sub(logp_s, logm, out=work).mul_(1 - beta)
    else:  # tvd; sign(0) = 0, the subgradient autograd takes for |x| at 0
        terms = 0.5 * (p_s - p_t).abs()
        u = torch.sub(p_s, p_t, out=work).sign_().mul_(0.5)
    reduced = all_reduce(torch.stack([terms.sum(1), (p_s * u).sum(1)], 1), dist.ReduceOp.SUM, group)
    return reduced[:, 0], _scaled_gradient(u, reduced[:, 1], p_s, scale_C, out=zs)


# Eagerly on the CPU, a chunk's chain runs over a few rows at a time, so that its passes over the
# [rows, V] buffers stay in the last-level cache instead of streaming from memory: as many rows as fill
# CACHE_BYTES with every buffer. Reverse KL over 512 rows of V=49152 (bench/README.md, "Default
# chunk"): 72 ms at once, 44 ms in blocks of 16 or 32 rows (9 and 19 MiB of buffers), 53 ms in blocks
# of 64 (38 MiB) on this machine's 32 MiB L3.
CACHE_BYTES = 16 << 20


def block_rows(buffers: dict[str, torch.Tensor]) -> int:
    """Rows a block of the eager chain takes (`CACHE_BYTES`)."""
    row_bytes = sum(b.shape[1] * b.element_size() for b in buffers.values())
    return max(1, CACHE_BYTES // row_bytes)


def soft_in_blocks(
    buffers: dict[str, torch.Tensor],
    rows: int,
    valid_V: torch.Tensor | None,
    kind: str,
    beta: float,
    scale_C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_value_and_grad` without tensor parallelism, `rows` rows at a time (each row's value and
    gradient depend on that row alone); the gradient takes the place of `zs`, as there. `valid_V` is
    [V], or [C, V] a mask per token."""
    per_token = valid_V is not None and valid_V.dim() == 2
    values = [
        soft_value_and_grad(
            {name: b[start : start + rows] for name, b in buffers.items()},
            valid_V[start : start + rows] if per_token and valid_V is not None else valid_V,
            kind,
            beta,
            scale_C[start : start + rows],
            None,
        )[0]
        for start in range(0, buffers["zs"].shape[0], rows)
    ]
    return torch.cat(values), buffers["zs"]


# The chunk chain as one compiled function per loss kind and chunk shape (issue: ~15 eager passes over
# each [C, V] buffer cost as much as the GEMMs on a GPU; compiled, one or two). A chain that fails to
# compile is run eagerly from then on, said once. `COMPILED` maps (kind, beta, shape, dtype, device)
# to the compiled function, or to None where compiling failed.
COMPILED: dict[tuple[Any, ...], Any] = {}
_log = logging.getLogger("mopd.divergence")


def cached_compile(chain: Any, key: tuple[Any, ...], scratch: list[torch.Tensor], *args: Any) -> Any:
    """`chain` compiled for calls like `chain(*args)`, proven on them first; None: run it eagerly.

    The proof runs the compiled chain once on `args` after zeroing `scratch` (the buffers the chain
    works in place on; the caller fills them afterwards), so that a compiler failure surfaces before any
    chunk depends on it, never halfway through one.
    """
    if key not in COMPILED:
        compiled: Any = torch.compile(chain, dynamic=False)
        try:
            for buffer in scratch:
                buffer.zero_()
            compiled(*args)
        except Exception as err:  # any compiler failure: the eager chain computes the same
            _log.warning("the divergence's chunk chain did not compile (%s); running it eagerly", err)
            compiled = None
        COMPILED[key] = compiled
    return COMPILED[key]


def shape_key(buffer: torch.Tensor) -> tuple[Any, ...]:
    return tuple(buffer.shape), buffer.dtype, buffer.device


# Tokens per chunk for `train.divergence.chunk_size: auto`: the smallest chunk within 10% of the best
# time measured (bench/README.md, "Default chunk"). CPU, fp32, N=8192, V=49152, H=576, fwd+bwd:
# 1024 takes 11.4 s, 512 11.5 s, 256 13.9 s. H200, bf16, N=8192, V=128256, H=4096, compiled chain:
# 4096 takes 0.103 s, 2048 0.109 s, 1024 0.114 s.
AUTO_CHUNK = {"cpu": 512, "cuda": 2048}


def chunk_size_for(setting: int | str, device: torch.device) -> int:
    """`train.divergence.chunk_size` for `device`: a number as it is, 'auto' the device's default."""
    if setting == "auto":
        return AUTO_CHUNK.get(device.type, AUTO_CHUNK["cpu"])
    if isinstance(setting, int) and setting > 0:
        return setting
    raise ValueError(f"chunk_size must be a positive number or auto, not {setting!r}")


def should_compile(setting: str, device: torch.device) -> bool:
    """`train.divergence.compile` for `device`: 'on', 'off', or 'auto' (on CUDA only: on the CPU the
    GEMMs dominate a chunk and compiling costs every process tens of seconds; bench/README.md)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, not {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def label_value_and_grad(
    logits_CV: torch.Tensor, local_C: torch.Tensor, scale_C: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """−log p_s(label) [C] and scale_C ⊙ its gradient [C, V] from tempered logits, in place; `local_C`
    holds the labels as this rank's column numbers (outside [0, V_local): another rank's)."""
    value_C, parts = label_values(logits_CV, local_C, group)
    return value_C, label_grad(parts, scale_C)


def label_values(
    logits_CV: torch.Tensor, local_C: torch.Tensor, group: Any
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """−log p_s(label) [C] from tempered logits (as `label_value_and_grad`), and what `label_grad`
    needs to form its gradient: the logits become exp(z − max) in place."""
    mine_C = (local_C >= 0) & (local_C < logits_CV.shape[1])
    at_C = torch.where(mine_C, local_C, 0)
    label_logit_C = torch.where(mine_C, logits_CV.gather(1, at_C[:, None])[:, 0], 0.0)
    max_C = all_reduce(logits_CV.amax(1), dist.ReduceOp.MAX, group)
    probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
    sums = all_reduce(torch.stack([probs_CV.sum(1), label_logit_C], 1), dist.ReduceOp.SUM, group)
    return max_C + sums[:, 0].log() - sums[:, 1], (probs_CV, sums[:, 0], at_C, mine_C)


def label_grad(parts: tuple[torch.Tensor, ...], scale_C: torch.Tensor) -> torch.Tensor:
    """scale_C ⊙ d(−log p_s(label)) / d logits [C, V], in place of `label_values`' exponentials."""
    probs_CV, total_C, at_C, mine_C = parts
    grad_CV = probs_CV.mul_((scale_C / total_C)[:, None])  # scale ⊙ (softmax − one-hot(label))
    # The owner's label column loses scale: a scatter of −scale·mine (0 elsewhere), without
    # data-dependent shapes.
    grad_CV.scatter_add_(1, at_C[:, None], -(scale_C * mine_C)[:, None])
    return grad_CV
