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


def soft_value_and_grad(
    buffers: dict[str, torch.Tensor], valid_V: torch.Tensor | None, kind: str, beta: float, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value [C] and d value / d z_s [C, V] from tempered logits, in place.

    `zs` and `zt` hold the tempered logits (masked columns −inf) and become log p_s and log p_t, then
    scratch; `ps` holds p_s. Reverse KL, cross-entropy and entropy need nothing more: 3 buffers of
    [C, V]. Forward KL adds `pt`; JSD and TVD add `work` and a few temporaries. Row sums use torch's
    pairwise reduction (a running dot product loses the 1e-6 agreement of KL = CE − H near values of 5).
    """
    zs, zt, ps = buffers["zs"], buffers["zt"], buffers["ps"]
    stats_max = all_reduce(torch.stack([zs.amax(1), zt.amax(1)], 1), dist.ReduceOp.MAX, group)
    zs.sub_(stats_max[:, :1])
    zt.sub_(stats_max[:, 1:])
    sum_s = torch.exp(zs, out=ps).sum(1)
    sum_t = torch.exp(zt, out=ps).sum(1)
    sums = all_reduce(torch.stack([sum_s, sum_t], 1), dist.ReduceOp.SUM, group)
    logp_s = zs.sub_(sums[:, :1].log())
    logp_t = zt.sub_(sums[:, 1:].log())
    p_s = torch.exp(logp_s, out=ps)
    p_t = torch.exp(logp_t, out=buffers["pt"]) if kind in NEEDS_P_T else None
    if valid_V is not None:  # padded columns: p = 0; make log p finite so that 0 · log p = 0
        logp_s.masked_fill_(~valid_V, 0.0)
        logp_t.masked_fill_(~valid_V, 0.0)

    if kind in ("reverse_kl", "cross_entropy", "entropy"):
        # u = ∂value/∂p_s overwrites one log-prob buffer; the product for the row sum uses the other.
        if kind == "reverse_kl":
            u, spare = torch.sub(logp_s, logp_t, out=logp_t), logp_s
        elif kind == "cross_entropy":
            u, spare = logp_t.neg_(), logp_s
        else:
            u, spare = logp_s.neg_(), logp_t
        value = all_reduce(torch.mul(p_s, u, out=spare).sum(1), dist.ReduceOp.SUM, group)
        return value, u.sub_(value[:, None]).mul_(p_s)
    assert p_t is not None
    if kind == "forward_kl":
        value = all_reduce(logp_t.sub_(logp_s).mul_(p_t).sum(1), dist.ReduceOp.SUM, group)
        return value, torch.sub(p_s, p_t, out=logp_s)
    work = buffers["work"]
    if kind == "jsd" and beta in (0.0, 1.0):  # m equals one side: both terms vanish
        return torch.zeros_like(stats_max[:, 0]), work.zero_()
    if kind == "jsd":
        logm = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log(1 - beta))
        terms = beta * p_t * (logp_t - logm) + (1 - beta) * p_s * (logp_s - logm)
        u = torch.sub(logp_s, logm, out=work).mul_(1 - beta)
    else:  # tvd; sign(0) = 0, the subgradient autograd takes for |x| at 0
        terms = 0.5 * (p_s - p_t).abs()
        u = torch.sub(p_s, p_t, out=work).sign_().mul_(0.5)
    reduced = all_reduce(torch.stack([terms.sum(1), (p_s * u).sum(1)], 1), dist.ReduceOp.SUM, group)
    return reduced[:, 0], u.sub_(reduced[:, 1:]).mul_(p_s)


# The chunk chain as one compiled function per loss kind and chunk shape (issue: ~15 eager passes over
# each [C, V] buffer cost as much as the GEMMs on a GPU; compiled, one or two). A chain that fails to
# compile is run eagerly from then on, said once. `COMPILED` maps (kind, beta, shape, dtype, device)
# to the compiled function, or to None where compiling failed.
COMPILED: dict[tuple[Any, ...], Any] = {}
_log = logging.getLogger("mopd.divergence")


def compiled_chain(chain: Any, key: tuple[Any, ...], scratch: list[torch.Tensor], *args: Any) -> Any:
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
# 1024 takes 11.8 s, 512 12.4 s, 256 14.4 s. H200, bf16, N=8192, V=128256, H=4096, compiled chain:
# 4096 takes 0.103 s, 2048 0.109 s, 1024 0.114 s.
AUTO_CHUNK = {"cpu": 512, "cuda": 2048}


def chunk_size_for(setting: int | str, device: torch.device) -> int:
    """`train.divergence.chunk_size` for `device`: a number as it is, 'auto' the device's default."""
    if setting == "auto":
        return AUTO_CHUNK.get(device.type, AUTO_CHUNK["cpu"])
    if isinstance(setting, int) and setting > 0:
        return setting
    raise ValueError(f"chunk_size must be a positive number or auto, not {setting!r}")


def compile_chain(setting: str, device: torch.device) -> bool:
    """`train.divergence.compile` for `device`: 'on', 'off', or 'auto' (on CUDA only: on the CPU the
    GEMMs dominate a chunk and compiling costs every process tens of seconds; bench/README.md)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, not {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def label_value_and_grad(
    logits_CV: torch.Tensor, local_C: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """−log p_s(label) [C] and its gradient [C, V] from tempered logits, in place; `local_C` holds the
    labels as this rank's column numbers (outside [0, V_local): another rank's)."""
    mine_C = (local_C >= 0) & (local_C < logits_CV.shape[1])
    at_C = torch.where(mine_C, local_C, 0)
    label_logit_C = torch.where(mine_C, logits_CV.gather(1, at_C[:, None])[:, 0], 0.0)
    max_C = all_reduce(logits_CV.amax(1), dist.ReduceOp.MAX, group)
    probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
    sums = all_reduce(torch.stack([probs_CV.sum(1), label_logit_C], 1), dist.ReduceOp.SUM, group)
    grad_CV = probs_CV.div_(sums[:, :1])  # softmax − one-hot(label), on the label's owner rank
    # The owner's label column loses 1: a scatter of −mine (0 elsewhere), without data-dependent shapes.
    grad_CV.scatter_add_(1, at_C[:, None], -mine_C.to(grad_CV.dtype)[:, None])
    return max_C + sums[:, 0].log() - sums[:, 1], grad_CV
