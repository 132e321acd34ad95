"""The loss of a microbatch whose tokens may have several teachers (DESIGN §14, docs/ensembles.md).

Each token's teachers are its row's set (`MicroBatch.teacher_set`); `teacher_hidden[t]` holds teacher t's
states for the tokens it scores, in token order. With w_k the teachers' `train.teacher_weights`, S a
token's set and W_S = Σ_{k∈S} w_k:

- `mixture`: D(p_s ‖ Σ_k (w_k / W_S) p_k), weighing W_S / |S| (one teacher: w_k, as routing gives);
- `confidence`: the same with w_k · max_v p_k(v) in place of w_k (each teacher's probability of its own
  top token, at T = 1: a sharper teacher counts for more where it is sure);
- `min_ce`: D(p_s ‖ p_k*) with k* = argmax_{k∈S} p_k(next token) at T = 1 (the lowest index on ties and
  where the row has no next token), weighing w_k*, as if the row were routed to k* at that token;
- `sum`: Σ_{k∈S} w_k D(p_s ‖ p_k), in one fused pass (the student's logits once a chunk).

A token whose teachers all weigh 0 trains nothing. Reports: the divergence per token keyed by the set of
its target (`min_ce`: the chosen teacher; `sum`: each teacher's own), and for `min_ce` and `confidence`
each teacher's share of the tokens of several teachers it scores (1 or 0 a token for `min_ce`, its
normalised weight for `confidence`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from mopd.store.format.transform import LogitTransform
from mopd.train.data.loader import MicroBatch
from mopd.train.kernel.divergence import linear_divergence
from mopd.train.kernel.ensemble import Member, mixture_divergence, sum_divergence, teacher_scores

METHODS = ("mixture", "sum", "min_ce", "confidence")


class EnsembleLoss(NamedTuple):
    loss: torch.Tensor
    per_token: torch.Tensor  # [N] each token's value (`sum`: Σ_k w_k D_k)
    reported: tuple[torch.Tensor, torch.Tensor]  # values [M] and the set (bits) each belongs to [M]
    shares: tuple[torch.Tensor, torch.Tensor] | None  # teacher [M'] and its share at a token it scores [M']


def scored_positions(teacher_set_N: torch.Tensor, teachers: list[int]) -> dict[int, torch.Tensor]:
    """The tokens (ascending) each teacher scores."""
    return {t: ((teacher_set_N >> t) & 1).nonzero()[:, 0] for t in teachers}


def ensemble_loss(
    method: str,
    hidden_NH: torch.Tensor,
    head: torch.Tensor,
    mb: MicroBatch,
    norm_N: torch.Tensor,
    weight_of: torch.Tensor,
    heads: Mapping[int, torch.Tensor],
    transforms: Mapping[int, LogitTransform],
    options: dict[str, Any],
) -> EnsembleLoss:
    """The loss of the microbatch's tokens under `method` (module docstring); `norm_N` each token's
    normaliser, `weight_of[t]` teacher t's weight, `heads` this rank's slice of each teacher's head."""
    assert mb.teacher_set is not None
    device = hidden_NH.device
    sets = mb.teacher_set.to(device)
    teachers = sorted(mb.teacher_hidden)
    positions = {t: p.to(device) for t, p in scored_positions(mb.teacher_set, teachers).items()}
    weight = weight_of.to(device)
    if method == "sum":
        return _sum(hidden_NH, head, mb, norm_N, weight, heads, transforms, options, positions)
    if method == "min_ce":
        return _min_ce(hidden_NH, head, mb, norm_N, weight, heads, transforms, options, positions)
    total = torch.zeros(sets.shape[0], device=device)
    count = torch.zeros(sets.shape[0], device=device)
    for t, pos in positions.items():
        total[pos] += weight[t]
        count[pos] += 1
    # A token whose teachers all weigh 0 trains nothing; its target is their plain mixture.
    member_weight = {t: torch.where(total[pos] > 0, weight[t], 1.0) for t, pos in positions.items()}
    shares = None
    if method == "confidence":
        for t, pos in positions.items():
            _, top = _scores(mb, t, pos, heads, transforms, options)
            member_weight[t] = member_weight[t] * top.exp()
        shares = _normalised(member_weight, positions, sets)
    members = {t: Member(pos, mb.teacher_hidden[t], member_weight[t]) for t, pos in positions.items()}
    mixture_options = {k: v for k, v in options.items() if k != "compiled"}
    out = mixture_divergence(
        hidden_NH,
        head,
        members,
        heads,
        weights=norm_N * total / count,
        teacher_transforms=transforms,
        **mixture_options,
    )
    return EnsembleLoss(out.loss, out.per_token, (out.per_token, sets), shares)


def _scores(
    mb: MicroBatch,
    t: int,
    pos: torch.Tensor,
    heads: Mapping[int, torch.Tensor],
    transforms: Mapping[int, LogitTransform],
    options: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher t's log-probabilities of the next token and of its own top token at its tokens."""
    return teacher_scores(
        mb.teacher_hidden[t],
        heads[t],
        mb.labels.to(pos.device)[pos],
        transform=transforms[t],
        chunk_size=options["chunk_size"],
        tp_group=options["tp_group"],
        vocab_start=options["vocab_start"],
        vocab_size=options["vocab_size"],
    )


def _shares(
    share_of: Mapping[int, torch.Tensor], positions: Mapping[int, torch.Tensor], sets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher [M], its share [M]) at each token of several teachers it scores; `share_of[t]`: teacher
    t's share at each of its tokens."""
    several = sets & (sets - 1) != 0
    teacher = torch.cat([torch.full_like(pos[several[pos]], t) for t, pos in positions.items()])
    share = torch.cat([share_of[t][several[pos]].float() for t, pos in positions.items()])
    return teacher, share


def _normalised(
    member_weight: Mapping[int, torch.Tensor], positions: Mapping[int, torch.Tensor], sets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's weight over its token's total, at the tokens of several teachers."""
    total = torch.zeros(sets.shape[0], device=sets.device)
    for t, pos in positions.items():
        total.index_add_(0, pos, member_weight[t].float())
    return _shares({t: member_weight[t] / total[pos] for t, pos in positions.items()}, positions, sets)


def _min_ce(
    hidden_NH: torch.Tensor,
    head: torch.Tensor,
    mb: MicroBatch,
    norm_N: torch.Tensor,
    weight: torch.Tensor,
    heads: Mapping[int, torch.Tensor],
    transforms: Mapping[int, LogitTransform],
    options: dict[str, Any],
    positions: Mapping[int, torch.Tensor],
) -> EnsembleLoss:
    """Each token routed to the teacher most likely to emit its next token."""
    device = hidden_NH.device
    num_tokens, width = hidden_NH.shape[0], max(positions) + 1
    scores = torch.full((num_tokens, width), float("-inf"), device=device)
    for t, pos in positions.items():
        label, _ = _scores(mb, t, pos, heads, transforms, options)
        # No next token: every member ties (the lowest index wins); a member never loses to a stranger.
        scores[pos, t] = torch.where(mb.labels.to(device)[pos] >= 0, label.clamp_min(-1e30), 0.0)
    chosen = scores.argmax(1)
    own = {t: mb.teacher_hidden[t][chosen[pos] == t] for t, pos in positions.items()}
    out = linear_divergence(
        hidden_NH,
        head,
        {t: h for t, h in own.items() if h.shape[0]},
        {t: heads[t] for t, h in own.items() if h.shape[0]},
        chosen,
        weights=norm_N * weight[chosen],
        teacher_transforms=transforms,
        **options,
    )
    picked = {t: (chosen[pos] == t).float() for t, pos in positions.items()}
    shares = _shares(picked, positions, mb.teacher_set.to(device))
    return EnsembleLoss(out.loss, out.per_token, (out.per_token, torch.ones_like(chosen) << chosen), shares)


def _sum(
    hidden_NH: torch.Tensor,
    head: torch.Tensor,
    mb: MicroBatch,
    norm_N: torch.Tensor,
    weight: torch.Tensor,
    heads: Mapping[int, torch.Tensor],
    transforms: Mapping[int, LogitTransform],
    options: dict[str, Any],
    positions: Mapping[int, torch.Tensor],
) -> EnsembleLoss:
    """Σ_k w_k D(p_s ‖ p_k) over each token's teachers, in one fused pass."""
    members = {
        t: Member(pos, mb.teacher_hidden[t], weight[t].expand(pos.shape[0])) for t, pos in positions.items()
    }
    out, each = sum_divergence(
        hidden_NH,
        head,
        members,
        heads,
        weights=norm_N,
        teacher_transforms=transforms,
        **{k: v for k, v in options.items() if k != "compiled"},
    )
    values = torch.cat([each[t].to(hidden_NH.device) for t in positions])
    keys = torch.cat([torch.full_like(pos, 1 << t) for t, pos in positions.items()])
    return EnsembleLoss(out.loss, out.per_token, (values, keys), None)
