"""The loss of a microbatch and the statistics of a step (DESIGN §7).

`Objective` weights each trained token's divergence to its own teacher (plus the optional hard-label CE,
and for teachers of other tokenizers the span log-likelihood match) on this rank's vocabulary shard;
`StepStats` sums the per-token values by teacher and reduces them over the ranks that report.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from mopd.base.errors import ConfigError
from mopd.config.train import DivergenceConfig
from mopd.store.format.layout import set_members
from mopd.store.format.manifest import Manifest
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.protocol import TrainStudent
from mopd.train.data.loader import MicroBatch, Spans
from mopd.train.ensembles import EnsembleLoss, ensemble_loss
from mopd.train.heads import TeacherHeads
from mopd.train.kernel.chunk_chain import chunk_size_for, should_compile
from mopd.train.kernel.divergence import linear_divergence
from mopd.train.kernel.labels import linear_cross_entropy
from mopd.train.kernel.projected import projected_divergence
from mopd.train.kernel.spans import span_likelihood_match, span_sums, teacher_log_probs
from mopd.train.report.metrics import DivergenceStats, set_key


class Terms(NamedTuple):
    """What the objective made of one microbatch."""

    loss: torch.Tensor  # with gradients: the weighted divergences, plus ce_weight × the CE term
    per_token: torch.Tensor  # [N] each trained token's divergence, before any weighting
    ce: torch.Tensor | None  # the hard-label CE term before ce_weight (None when ce_weight is 0)
    span: torch.Tensor | None = None  # the span term before its weight (None: no trained span)
    # Tokens of several teachers (`ensembles.EnsembleLoss`): the values to report, each with the set
    # (bits) of its target, and each teacher's share at the tokens it scores.
    reported: tuple[torch.Tensor, torch.Tensor] | None = None
    shares: tuple[torch.Tensor, torch.Tensor] | None = None


def teacher_weights(manifest: Manifest, by_alias: dict[str, float]) -> dict[int, float]:
    """Weight of each teacher index from `train.teacher_weights` (alias → weight, default 1).

    Aliases are those the store recorded for each teacher; aliases of one teacher must agree.
    """
    known = {alias for teacher in manifest.teachers for alias in teacher.aliases}
    for alias in sorted(set(by_alias) - known):
        raise ConfigError(
            f"train.teacher_weights.{alias}: the store has no teacher under this alias "
            f"(its aliases: {', '.join(sorted(known))})"
        )
    weights = {}
    for teacher in manifest.teachers:
        given = {alias: by_alias.get(alias, 1.0) for alias in teacher.aliases}
        if len(set(given.values())) > 1:
            raise ConfigError(
                f"train.teacher_weights: aliases {sorted(given)} share teacher {teacher.index} "
                f"({teacher.checkpoint}) but have different weights {given}; give them one weight"
            )
        weights[teacher.index] = next(iter(given.values()), 1.0)
    return weights


class Objective:
    """The loss of one microbatch: weighted divergence to each token's teacher (+ hard-label CE)."""

    def __init__(
        self,
        cfg: DivergenceConfig,
        heads: TeacherHeads,
        weights: dict[int, float],
        vocab_size: int,
        student: TrainStudent,
        vocab_slice: tuple[int, int],
        device: torch.device,
        span_weight: float = 0.0,
        ensemble: str = "mixture",
    ) -> None:
        self.cfg, self.heads, self.vocab_size = cfg, heads, vocab_size
        self.ensemble = ensemble  # train.ensemble.method, for tokens of several teachers
        self.span_weight = span_weight  # train.cross_tokenizer.span_weight
        # The config's "auto" settings, resolved once for the device the student computes on.
        self.chunk_size = chunk_size_for(cfg.chunk_size, device)
        self.compiled = should_compile(cfg.compile, device)
        # This rank's vocabulary shard of the student's output layer and of every teacher head: the
        # rows [start, stop) of the distilled vocabulary (see train/vocabulary.py); the kernels mask any
        # column at or past `vocab_size`, and an hf student's padding rows past it are cut off here.
        start, stop = vocab_slice
        self.local_rows = stop - start
        self.shard = dict(tp_group=student.tp_group, vocab_start=start, vocab_size=vocab_size)
        self.weight_of = torch.zeros(max(weights) + 1)
        for t, w in weights.items():
            self.weight_of[t] = w

    def __call__(
        self, hidden_NH: torch.Tensor, head: torch.Tensor, mb: MicroBatch, norm_N: torch.Tensor
    ) -> Terms:
        cfg = self.cfg
        head = head[: self.local_rows]
        weights_N = norm_N * self.weight_of[mb.teacher_index].to(norm_N.device)
        options = dict(
            kind=cfg.kind,
            beta=cfg.beta,
            temperature=cfg.temperature,
            chunk_size=self.chunk_size,
            compiled=self.compiled,
            **self.shard,
        )
        ensemble = None
        if mb.teacher_set is not None:
            ensemble, span = self._ensemble(hidden_NH, head, mb, norm_N, options)
            loss, per_token = ensemble.loss, ensemble.per_token
        elif self.heads.all_on_device and not self.heads.projections:
            out = linear_divergence(
                hidden_NH,
                head,
                mb.teacher_hidden,
                self.heads.resident(),
                mb.teacher_index,
                weights=weights_N,
                teacher_transforms=self.heads.transforms,
                **options,
            )
            loss, per_token, span = out.loss, out.per_token, None
        else:
            loss, per_token, span = self._by_teacher(hidden_NH, head, mb, weights_N, options)
        if span is not None:
            loss = loss + self.span_weight * span
            span = span.detach()
        ce = None
        if cfg.ce_weight > 0:
            ce = linear_cross_entropy(
                hidden_NH,
                head,
                mb.labels,
                weights=norm_N,
                chunk_size=self.chunk_size,
                compiled=self.compiled,
                **self.shard,
            )
            loss = loss + cfg.ce_weight * ce.loss
        reported = None if ensemble is None else ensemble.reported
        shares = None if ensemble is None else ensemble.shares
        return Terms(loss, per_token, None if ce is None else ce.loss.detach(), span, reported, shares)

    def _ensemble(
        self,
        hidden_NH: torch.Tensor,
        head: torch.Tensor,
        mb: MicroBatch,
        norm_N: torch.Tensor,
        options: dict[str, Any],
    ) -> tuple[EnsembleLoss, torch.Tensor | None]:
        """Tokens of several teachers (`ensembles`), every head of the microbatch's teachers on the
        device together; with the span term of its teachers of other tokenizers (None: no trained
        span), each span weighing as its tokens' weights under routing would."""
        teachers = sorted(mb.teacher_hidden)
        spans = self._trained_spans(mb)
        with self.heads.use_set(teachers) as heads:
            out = ensemble_loss(
                self.ensemble,
                hidden_NH,
                head,
                mb,
                norm_N,
                self.weight_of,
                heads,
                self.heads.transforms,
                options,
                self.heads.projections,
            )
            if spans is None:
                return out, None
            parts = [self._span_likelihood(spans, t, heads[t]) for t in spans.teacher]
        # A span's tokens weigh as its teacher's (the row's teacher of another tokenizer) under routing.
        assert mb.teacher_set is not None
        weights_N = norm_N
        for t in spans.teacher:
            mine = ((mb.teacher_set >> t) & 1).bool().to(norm_N.device)
            weights_N = torch.where(mine, norm_N * self.weight_of[t], weights_N)
        likelihood = torch.stack(parts).sum(0)
        return out, self._span_term(hidden_NH, head, mb, spans, likelihood, weights_N)

    def _trained_spans(self, mb: MicroBatch) -> Spans | None:
        """The microbatch's trained spans, where the span term is on and it has any."""
        return mb.spans if self.span_weight > 0 and mb.spans is not None and mb.spans.count else None

    def _span_likelihood(self, spans: Spans, t: int, teacher_head: torch.Tensor) -> torch.Tensor:
        """[S] teacher t's log-likelihood of each trained span it reads (0 for the others')."""
        likelihood = torch.zeros(spans.count, dtype=torch.float64, device=teacher_head.device)
        if t in spans.teacher:
            side = spans.teacher[t]
            log_probs = teacher_log_probs(
                side.hidden, teacher_head, side.targets, transform=self.heads.transforms[t]
            )
            likelihood += span_sums(log_probs, side.span, spans.count)
        return likelihood

    def _by_teacher(
        self,
        hidden_NH: torch.Tensor,
        head: torch.Tensor,
        mb: MicroBatch,
        weights_N: torch.Tensor,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One teacher's head on the device at a time: a teacher of the student's vocabulary through
        `linear_divergence`, one of another tokenizer through `projected_divergence` on the tokens an
        aligned teacher position supervises (the others' per-token values stay 0) and, while its head is
        there, its log-likelihood of each trained span. Returns the loss, the per-token values and the
        span term (None: no trained span)."""
        loss = hidden_NH.new_zeros(())
        per_token = torch.zeros(hidden_NH.shape[0], device=hidden_NH.device)
        supervised = (
            mb.aligned if mb.aligned is not None else torch.ones_like(mb.teacher_index, dtype=torch.bool)
        )
        spans = self._trained_spans(mb)
        likelihood = torch.zeros(spans.count if spans else 0, dtype=torch.float64, device=hidden_NH.device)
        for t in sorted(mb.teacher_hidden):
            sel = ((mb.teacher_index == t) & supervised).nonzero()[:, 0].to(hidden_NH.device)
            with self.heads.use(t) as teacher_head:
                if spans is not None:
                    likelihood += self._span_likelihood(spans, t, teacher_head)
                if t in self.heads.projections:
                    out = projected_divergence(
                        hidden_NH[sel],
                        head,
                        mb.teacher_hidden[t],
                        teacher_head,
                        self.heads.projections[t],
                        weights=weights_N[sel],
                        teacher_transform=self.heads.transforms[t],
                        **options,
                    )
                else:
                    out = linear_divergence(
                        hidden_NH[sel],
                        head,
                        mb.teacher_hidden[t],
                        {t: teacher_head},
                        None,
                        weights=weights_N[sel],
                        teacher_transforms=self.heads.transforms,
                        **options,
                    )
            loss = loss + out.loss
            per_token[sel] = out.per_token
        span = None if spans is None else self._span_term(hidden_NH, head, mb, spans, likelihood, weights_N)
        return loss, per_token, span

    def _span_term(
        self,
        hidden_NH: torch.Tensor,
        head: torch.Tensor,
        mb: MicroBatch,
        spans: Spans,
        likelihood_S: torch.Tensor,
        weights_N: torch.Tensor,
    ) -> torch.Tensor:
        """The span log-likelihood match over the trained spans, each weighing as one trained token (the
        mean of its tokens' weights)."""
        of_token = spans.of_token.to(hidden_NH.device)
        sel = (of_token >= 0).nonzero()[:, 0]
        ones = torch.ones(sel.shape[0], device=hidden_NH.device)
        tokens_S = span_sums(ones, of_token[sel], spans.count)
        weights_S = span_sums(weights_N[sel], of_token[sel], spans.count) / tokens_S
        out = span_likelihood_match(
            hidden_NH[sel],
            head,
            mb.labels[sel],
            of_token[sel],
            likelihood_S,
            weights_S,
            chunk_size=self.chunk_size,
            **self.shard,
        )
        return out.loss


class StepStats:
    """Sums over trained tokens, per teacher (and per set of teachers whose mixture is a target, after
    the teachers: `sets`, as `layout.set_mask` bits), reduced over the data-parallel ranks."""

    def __init__(self, num_teachers: int, cross: Collection[int] = (), sets: Sequence[int] = ()) -> None:
        self.local_nonfinite = 0.0  # this rank's own count, kept through `reduce`
        self.num_teachers = num_teachers
        self.labels = [str(t) for t in range(num_teachers)] + [set_key(set_members(m)) for m in sets]
        self.set_index = {m: num_teachers + k for k, m in enumerate(sets)}
        size = len(self.labels)
        self.sums = torch.zeros(size, dtype=torch.float64)
        self.counts = torch.zeros(size, dtype=torch.float64)
        # Teachers of other tokenizers (`cross`): their trained tokens with and without an aligned
        # teacher position (`add_alignment`).
        self.cross = sorted(cross)
        self.aligned = torch.zeros(num_teachers, dtype=torch.float64)
        self.unaligned = torch.zeros(num_teachers, dtype=torch.float64)
        self.extremes = torch.tensor([math.inf, math.inf], dtype=torch.float64)  # min, −max: both minimised
        self.nonfinite = torch.zeros(size, dtype=torch.float64)
        # Ensembles that choose (`Terms.shares`): each teacher's summed share and tokens it scores.
        self.selected = torch.zeros(num_teachers, dtype=torch.float64)
        self.scored = torch.zeros(num_teachers, dtype=torch.float64)
        self.loss = torch.zeros((), dtype=torch.float64)
        self.ce: torch.Tensor | None = None  # the CE term's sum over the microbatches, when it is on
        self.span: torch.Tensor | None = None  # the span term's, when a microbatch had trained spans

    def keys(self, sets: torch.Tensor) -> torch.Tensor:
        """The stats index of each value's target set (`layout.set_mask` bits)."""
        masks = sets.cpu().tolist()
        return torch.tensor(
            [m.bit_length() - 1 if m & (m - 1) == 0 else self.set_index[m] for m in masks], dtype=torch.long
        )

    def add_alignment(self, mb: MicroBatch) -> None:
        """Counts each teacher of another tokenizer's trained tokens of the microbatch with and without
        an aligned position of its own (`MicroBatch.aligned`)."""
        if mb.aligned is None:
            return
        aligned = mb.aligned.cpu()
        for t in self.cross:
            sets = mb.teacher_set
            mine = mb.teacher_index == t if sets is None else ((sets.cpu() >> t) & 1).bool()
            self.aligned[t] += float((mine & aligned).sum())
            self.unaligned[t] += float((mine & ~aligned).sum())

    def add_shares(self, teacher: torch.Tensor, share: torch.Tensor) -> None:
        self.selected.index_add_(0, teacher.cpu(), share.detach().double().cpu())
        self.scored.index_add_(0, teacher.cpu(), torch.ones(teacher.shape[0], dtype=torch.float64))

    def add(
        self,
        per_token: torch.Tensor,
        teacher: torch.Tensor,
        loss: torch.Tensor,
        ce: torch.Tensor | None,
        *,
        span: torch.Tensor | None = None,
    ) -> None:
        """`per_token` and `teacher`: the tokens with a divergence, and the stats index of each."""
        values = per_token.detach().double().cpu()
        finite = torch.isfinite(values)
        self.nonfinite.index_add_(0, teacher[~finite], torch.ones(int((~finite).sum()), dtype=torch.float64))
        self.sums.index_add_(0, teacher, values)
        self.counts.index_add_(0, teacher, torch.ones_like(values))
        if values.numel():
            self.extremes = torch.minimum(self.extremes, torch.stack([values.min(), -values.max()]))
        self.loss += loss.detach().double().cpu()
        if ce is not None:
            self.ce = (0 if self.ce is None else self.ce) + ce.double().cpu()
        if span is not None:
            self.span = (0 if self.span is None else self.span) + span.double().cpu()

    def reduce(self, dp: RankGroup) -> None:
        """Sums over the ranks of `dp` (ranks that report nothing add zeros)."""
        self.local_nonfinite = float(self.nonfinite.sum())
        zero = torch.zeros((), dtype=torch.float64)
        ce = zero if self.ce is None else self.ce
        # The span term and whether this rank had one: a rank without trained spans adds zeros.
        span = torch.stack([zero, zero] if self.span is None else [self.span, zero + 1])
        names = ("sums", "counts", "nonfinite", "aligned", "unaligned", "selected", "scored")
        parts = [getattr(self, name) for name in names]
        packed = dp.all_reduce(torch.cat([*parts, self.loss[None], ce[None], span]))
        for name, part in zip(names, packed[:-4].split([part.shape[0] for part in parts]), strict=True):
            setattr(self, name, part)
        self.loss = packed[-4]
        if self.ce is not None:
            self.ce = packed[-3]
        self.span = packed[-2] if packed[-1] > 0 else None
        self.extremes = dp.all_reduce(self.extremes, dist.ReduceOp.MIN)

    def divergences(self) -> DivergenceStats:
        present = self.counts > 0
        total = float(self.counts.sum())
        stats = DivergenceStats(
            divergence=float(self.sums.sum()) / total if total else 0.0,
            divergence_by_teacher={
                self.labels[t]: float(self.sums[t] / self.counts[t]) for t in present.nonzero()[:, 0].tolist()
            },
            divergence_min=float(self.extremes[0]) if total else 0.0,
            divergence_max=float(-self.extremes[1]) if total else 0.0,
            trained_tokens=int(total),
        )
        trained = self.aligned + self.unaligned
        shares = {str(t): float(self.aligned[t] / trained[t]) for t in self.cross if trained[t] > 0}
        if shares:  # the share of each such teacher's trained tokens that an aligned position supervised
            stats["aligned_share_by_teacher"] = shares
        chosen = {
            str(t): float(self.selected[t] / self.scored[t]) for t in self.scored.nonzero()[:, 0].tolist()
        }
        if chosen:
            stats["selection_share_by_teacher"] = chosen
        return stats
