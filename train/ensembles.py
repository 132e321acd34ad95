"""The loss of a microbatch whose tokens may have several teachers (DESIGN §14, docs/ensembles.md).

Each token's teachers are its row's set (`MicroBatch.teacher_set`); `teacher_hidden[t]` holds teacher t's
states for the tokens it scores, in token order. With w_k the teachers' `train.teacher_weights`, S a
token's set and W_S = Σ_{k∈S} w_k:

- `mixture`: D(p_s ‖ Σ_k (w_k / W_S) p_k), weighing W_S / |S| (one teacher: w_k, as routing gives);
- `confidence`: the same with w_k · max_v p_k(v) in place of w_k (each teacher's probability of its own
  top token, at T = 1: a sharper teacher counts for more where it is sure), in the same one pass;
- `min_ce`: D(p_s ‖ p_k*) with k* = argmax_{k∈S} p_k(next token) at T = 1 (the lowest index on ties and
  where the row has no next token), weighing w_k*, as if the row were routed to k* at that token;
- `sum`: Σ_{k∈S} w_k D(p_s ‖ p_k), in one fused pass (the student's logits once a chunk).

A token whose teachers all weigh 0 trains nothing. Reports: the divergence per token keyed by the set of
its target (`min_ce`: the chosen teacher; `sum`: each teacher's own), and for `min_ce` and `confidence`
each teacher's share of the tokens of several teachers it scores (1 or 0 a token for `min_ce`, its
normalised weight for `confidence`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mopd.store.format.transform import LogitTransform
from mopd.tokens.projection import Projection
from mopd.train.data.loader import MicroBatch
from mopd.train.kernel.ensemble import Member, mixture_divergence

METHODS = ("mixture", "sum", "min_ce", "confidence")


class EnsembleLoss(NamedTuple):
    loss: torch.Tensor
    per_token: torch.Tensor  # [N] each token's value (`sum`: Σ_k w_k D_k)
    reported: tuple[torch.Tensor, torch.Tensor]  # values [M] and the set (bits) each belongs to [M]
    shares: tuple[torch.Tensor, torch.Tensor] | None  # teacher [M'] and its share at a token it scores [M']


def scored_positions(
    teacher_set_N: torch.Tensor,
    teachers: list[int],
    aligned_N: torch.Tensor | None = None,
    others: Collection[int] = (),
) -> dict[int, torch.Tensor]:
    """The tokens (ascending) each teacher scores: those of its rows, and for a teacher of another
    tokenizer (`others`) those of them where it has an aligned position (`aligned_N`)."""
    out = {}
    for t in teachers:
        mine = ((teacher_set_N >> t) & 1).bool()
        if t in others and aligned_N is not None:
            mine &= aligned_N
        out[t] = mine.nonzero()[:, 0]
    return out


@dataclass(frozen=True)
class _Tokens:
    """One call's inputs: the student's side, the tokens' labels and sets, each token's normaliser, each
    teacher's states, weight, head and transform, the kernel's options, and the tokens each scores."""

    hidden: torch.Tensor
    head: torch.Tensor
    labels: torch.Tensor
    sets: torch.Tensor
    norm: torch.Tensor
    teacher_hidden: Mapping[int, torch.Tensor]
    weight: torch.Tensor
    heads: Mapping[int, torch.Tensor]
    transforms: Mapping[int, LogitTransform]
    options: dict[str, Any]
    positions: dict[int, torch.Tensor]
    projections: Mapping[int, Projection]

    def members(self, weight_of: Mapping[int, torch.Tensor] | None = None) -> dict[int, Member]:
        """Each teacher's `Member`: its tokens, states and weight there (`weight_of[t]`, else its weight
        at every token), and its projection where its vocabulary is not the student's."""
        return {
            t: Member(
                pos,
                self.teacher_hidden[t],
                weight_of[t] if weight_of is not None else self.weight[t].expand(pos.shape[0]),
                self.projections.get(t),
            )
            for t, pos in self.positions.items()
        }

    def kernel_options(self) -> dict[str, Any]:
        """The options the ensemble kernel takes (it has no compiled chain)."""
        return {k: v for k, v in self.options.items() if k != "compiled"}


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
    projections: Mapping[int, Projection] | None = None,
) -> EnsembleLoss:
    """The loss of the microbatch's tokens under `method` (module docstring); `norm_N` each token's
    normaliser, `weight_of[t]` teacher t's weight, `heads` this rank's slice of each teacher's head
    (a teacher of another vocabulary: its whole head, and its projection in `projections`). A token no
    teacher scores (its row's teacher of another tokenizer alone, with no aligned position there) has
    no divergence: its value is 0 and it is not reported."""
    assert mb.teacher_set is not None
    device, projections = hidden_NH.device, projections or {}
    aligned = None if mb.aligned is None else mb.aligned.to(mb.teacher_set.device)
    positions = scored_positions(mb.teacher_set, sorted(mb.teacher_hidden), aligned, projections.keys())
    covered = torch.zeros(mb.teacher_set.shape[0], dtype=torch.bool)
    for pos in positions.values():
        covered[pos.cpu()] = True
    keep = covered.nonzero()[:, 0].to(device)
    at = (torch.cumsum(covered, 0) - 1).to(device)  # each covered token's place among them
    pick = (lambda x: x) if bool(covered.all()) else (lambda x: x[keep])  # no copy where all are
    tokens = _Tokens(
        pick(hidden_NH),
        head,
        pick(mb.labels.to(device)),
        pick(mb.teacher_set.to(device)),
        pick(norm_N),
        mb.teacher_hidden,
        weight_of.to(device),
        heads,
        transforms,
        options,
        {t: at[pos.to(device)] for t, pos in positions.items()},
        projections,
    )
    if method == "sum":
        out = _sum(tokens)
    elif method == "min_ce":
        out = _min_ce(tokens)
    else:
        out = _mixture(tokens, confident=method == "confidence")
    per_token = torch.zeros(hidden_NH.shape[0], device=device, dtype=out.per_token.dtype)
    return out._replace(per_token=per_token.index_copy_(0, keep, out.per_token))


def _mixture(x: _Tokens, *, confident: bool) -> EnsembleLoss:
    """The mixture of each token's teachers, weighted by their weights (× their top-token probability
    when `confident`)."""
    sets = x.sets
    total = torch.zeros(sets.shape[0], device=sets.device)
    count = torch.zeros(sets.shape[0], device=sets.device)
    for t, pos in x.positions.items():
        total[pos] += x.weight[t]
        count[pos] += 1
    # A token whose teachers all weigh 0 trains nothing; its target is their plain mixture.
    member_weight = {t: torch.where(total[pos] > 0, x.weight[t], 1.0) for t, pos in x.positions.items()}
    members = x.members(member_weight)
    out = mixture_divergence(
        x.hidden,
        x.head,
        members,
        x.heads,
        weights=x.norm * total / count,
        teacher_transforms=x.transforms,
        confident=confident,
        **x.kernel_options(),
    )
    shares = None
    if out.by_teacher is not None:  # confident: each teacher's normalised weight at its tokens
        shares = _shares({t: w.to(sets.device) for t, w in out.by_teacher.items()}, x.positions, sets)
    return EnsembleLoss(out.loss, out.per_token, (out.per_token, sets), shares)


def _shares(
    share_of: Mapping[int, torch.Tensor], positions: Mapping[int, torch.Tensor], sets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher [M], its share [M]) at each token of several teachers it scores; `share_of[t]`: teacher
    t's share at each of its tokens."""
    several = sets & (sets - 1) != 0
    teacher = torch.cat([torch.full_like(pos[several[pos]], t) for t, pos in positions.items()])
    share = torch.cat([share_of[t][several[pos]].float() for t, pos in positions.items()])
    return teacher, share


def _min_ce(x: _Tokens) -> EnsembleLoss:
    """Each token routed to the teacher most likely to emit its next token, chosen in the kernel's pass."""
    members = x.members()
    out = mixture_divergence(
        x.hidden,
        x.head,
        members,
        x.heads,
        weights=x.norm,
        teacher_transforms=x.transforms,
        combine="min_ce",
        labels=x.labels,
        **x.kernel_options(),
    )
    assert out.by_teacher is not None
    chosen = torch.zeros_like(x.sets)
    for t, pos in x.positions.items():
        chosen[pos] += t * out.by_teacher[t].to(pos.device).long()
    shares = _shares({t: p.to(x.sets.device) for t, p in out.by_teacher.items()}, x.positions, x.sets)
    return EnsembleLoss(out.loss, out.per_token, (out.per_token, torch.ones_like(chosen) << chosen), shares)


def _sum(x: _Tokens) -> EnsembleLoss:
    """Σ_k w_k D(p_s ‖ p_k) over each token's teachers, in one fused pass."""
    members = x.members()
    out = mixture_divergence(
        x.hidden,
        x.head,
        members,
        x.heads,
        weights=x.norm,
        teacher_transforms=x.transforms,
        combine="sum",
        **x.kernel_options(),
    )
    assert out.by_teacher is not None
    values = torch.cat([out.by_teacher[t].to(x.hidden.device) for t in x.positions])
    keys = torch.cat([torch.full_like(pos, 1 << t) for t, pos in x.positions.items()])
    return EnsembleLoss(out.loss, out.per_token, (values, keys), None)
