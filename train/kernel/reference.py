"""The plain, unfused divergence: materialised logits and autograd. For tests and benchmarks only.

It holds [N, V] tensors for both sides (and autograd keeps several more), which is what the fused kernel
in `divergence.py` exists to avoid. Same arguments and semantics, single process, full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mopd.store.format.transform import LogitTransform
from mopd.tokens.projection import Projection
from mopd.train.kernel.divergence import DivergenceOutput


def reference_divergence(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor | Mapping[int, torch.Tensor],
    teacher_heads: Mapping[int, torch.Tensor],
    teacher_index: torch.Tensor | None,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weights: torch.Tensor | None = None,
    vocab_size: int | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
) -> DivergenceOutput:
    """Computes in float64 when the student inputs are float64, else float32."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    num_tokens = student_hidden.shape[0]
    vocab_size = student_head.shape[0] if vocab_size is None else vocab_size
    if teacher_index is None:
        teacher_index = torch.full((num_tokens,), next(iter(teacher_heads)), dtype=torch.long)
    zs = (student_hidden.to(dtype) @ student_head.to(dtype).T)[:, :vocab_size] / temperature
    zt = torch.empty_like(zs.detach())
    for t in teacher_index.unique().tolist():
        mask = teacher_index == t
        rows = teacher_hidden[t] if isinstance(teacher_hidden, Mapping) else teacher_hidden[mask]
        transform = (teacher_transforms or {}).get(t, LogitTransform())
        logits = transform.apply(rows.to(dtype) @ teacher_heads[t].to(dtype).T)
        zt[mask] = logits[:, :vocab_size] / temperature
    return _weighted(zs.log_softmax(-1), zt.log_softmax(-1), kind, beta, weights)


def reference_mixture(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    members: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    teacher_heads: Mapping[int, torch.Tensor],
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weights: torch.Tensor | None = None,
    teacher_transforms: Mapping[int, LogitTransform] | None = None,
) -> DivergenceOutput:
    """`ensemble.mixture_divergence` written out: every teacher's [N_t, V] distribution materialised,
    mixed as log Σ_k (w_k / Σ w) p_k. `members`: teacher → (positions, hidden rows, weights)."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    zs = (student_hidden.to(dtype) @ student_head.to(dtype).T) / temperature
    parts = torch.full((len(members), *zs.shape), float("-inf"), dtype=dtype)
    total = torch.zeros(zs.shape[0], dtype=dtype)
    for k, (t, (positions, hidden, weight)) in enumerate(members.items()):
        transform = (teacher_transforms or {}).get(t, LogitTransform())
        logits = transform.apply(hidden.to(dtype) @ teacher_heads[t].to(dtype).T) / temperature
        parts[k, positions] = logits.log_softmax(-1) + weight.to(dtype).log()[:, None]
        total[positions] += weight.to(dtype)
    logp_t = parts.logsumexp(0) - total.log()[:, None]
    return _weighted(zs.log_softmax(-1), logp_t, kind, beta, weights)


def _weighted(
    logp_s: torch.Tensor,
    logp_t: torch.Tensor,
    kind: str,
    beta: float,
    weights: torch.Tensor | None,
    *,
    reach: torch.Tensor | None = None,
) -> DivergenceOutput:
    """Σ_n weights_n · D(p_s ‖ p_t) of the kind, from both sides' log-probabilities; outside `reach`
    (where given) both are 0 and add nothing."""
    num_tokens, dtype = logp_s.shape[0], logp_s.dtype
    p_s, p_t = logp_s.exp(), logp_t.exp()
    if reach is not None:
        logp_s, logp_t = logp_s.masked_fill(~reach, 0.0), logp_t.masked_fill(~reach, 0.0)
    if kind == "reverse_kl":
        value = (p_s * (logp_s - logp_t)).sum(-1)
    elif kind == "forward_kl":
        value = (p_t * (logp_t - logp_s)).sum(-1)
    elif kind == "cross_entropy":
        value = -(p_s * logp_t).sum(-1)
    elif kind == "entropy":
        value = -(p_s * logp_s).sum(-1)
    elif kind == "jsd":
        m = beta * p_t + (1 - beta) * p_s
        logm = (m if reach is None else m.masked_fill(~reach, 1.0)).log()  # outside: 0, no 1/0 gradient
        value = beta * (p_t * (logp_t - logm)).sum(-1) + (1 - beta) * (p_s * (logp_s - logm)).sum(-1)
    elif kind == "tvd":
        value = 0.5 * (p_s - p_t).abs().sum(-1)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    weights = (
        torch.full((num_tokens,), 1.0 / num_tokens, dtype=dtype) if weights is None else weights.to(dtype)
    )
    return DivergenceOutput(loss=(weights * value).sum(), per_token=value.detach())


def reference_ensemble(
    method: str,
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_set: torch.Tensor,
    teacher_hidden: Mapping[int, torch.Tensor],
    teacher_heads: Mapping[int, torch.Tensor],
    teacher_weight: Mapping[int, float],
    labels: torch.Tensor,
    norm: torch.Tensor,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    projections: Mapping[int, Projection] | None = None,
) -> DivergenceOutput:
    """`train.ensembles.ensemble_loss` written out from its definitions (DESIGN §14), every teacher's
    [N_t, V] distribution materialised: `teacher_set` [N] each token's teachers as bits,
    `teacher_hidden[t]` teacher t's rows for its tokens in order, `labels` [N] each token's next token
    (negative: none), `norm` [N] each token's normaliser. The per-token values are those the objective
    reports: the divergence to the target, for `sum` Σ_k w_k D_k. A teacher of another vocabulary
    (`projections[t]`) has its distribution, at T and at 1, projected densely onto the student's; each
    token's divergence runs over the student tokens its target reaches."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    zs = (student_hidden.to(dtype) @ student_head.to(dtype).T) / temperature
    positions = {t: ((teacher_set >> t) & 1).nonzero()[:, 0] for t in sorted(teacher_hidden)}
    # Each teacher's log-probabilities at its tokens: at T, and at T = 1.
    tempered, own = _log_probs(teacher_hidden, teacher_heads, projections or {}, dtype, temperature)
    total = torch.zeros(norm.shape[0], dtype=dtype)
    count = torch.zeros(norm.shape[0], dtype=dtype)
    for t, pos in positions.items():
        total[pos] += teacher_weight[t]
        count[pos] += 1
    if method == "sum":
        value = torch.zeros(norm.shape[0], dtype=dtype)
        loss = torch.zeros((), dtype=dtype)
        for t, pos in positions.items():
            out = _restricted(zs[pos], tempered[t], kind, beta, norm[pos].to(dtype) * teacher_weight[t])
            loss = loss + out.loss
            value[pos] += teacher_weight[t] * out.per_token
        return DivergenceOutput(loss=loss, per_token=value.detach())
    if method == "min_ce":
        best = _most_likely(positions, own, labels)
        weight = torch.tensor([teacher_weight[int(t)] for t in best], dtype=dtype)
        target = torch.empty_like(zs)
        for t, pos in positions.items():
            target[pos[best[pos] == t]] = tempered[t][best[pos] == t]
        return _restricted(zs, target, kind, beta, norm.to(dtype) * weight)
    mix = torch.full((len(positions), *zs.shape), float("-inf"), dtype=dtype)
    weight_sum = torch.zeros(norm.shape[0], dtype=dtype)
    weights = {}
    for t, pos in positions.items():
        w = torch.where(total[pos] > 0, teacher_weight[t], 1.0).to(dtype)
        weights[t] = w * own[t].max(-1).values.exp() if method == "confidence" else w
        weight_sum[pos] += weights[t]
    for k, (t, pos) in enumerate(positions.items()):
        mix[k, pos] = tempered[t] + weights[t].log()[:, None]
    logp_t = mix.logsumexp(0) - weight_sum.log()[:, None]
    return _restricted(zs, logp_t, kind, beta, norm.to(dtype) * total / count)


def _log_probs(
    teacher_hidden: Mapping[int, torch.Tensor],
    teacher_heads: Mapping[int, torch.Tensor],
    projections: Mapping[int, Projection],
    dtype: torch.dtype,
    temperature: float,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Each teacher's log-probabilities over the student's vocabulary at its tokens, at T and at T = 1
    (a teacher of another vocabulary's projected from its own distribution at each)."""
    tempered, own = {}, {}
    for t in sorted(teacher_hidden):
        projection = projections.get(t)
        head = teacher_heads[t] if projection is None else teacher_heads[t][: projection.teacher_vocab]
        logits = teacher_hidden[t].to(dtype) @ head.to(dtype).T
        tempered[t], own[t] = (logits / temperature).log_softmax(-1), logits.log_softmax(-1)
        if projection is not None:
            tempered[t] = projected_log_probs(tempered[t], projection)
            own[t] = projected_log_probs(own[t], projection)
    return tempered, own


def projected_log_probs(logp_NVt: torch.Tensor, projection: Projection) -> torch.Tensor:
    """[N, Vs] log Σ_j p(j) P[j, k]: a teacher's log-probabilities over its vocabulary projected densely
    onto the student's (−inf where no entry lands)."""
    dense = torch.zeros(projection.teacher_vocab, projection.student_vocab, dtype=logp_NVt.dtype)
    dense.index_put_(
        (projection.source, projection.target), projection.weight.to(dense.dtype), accumulate=True
    )
    # [N, Vt, Vs]: fine for the tests' vocabularies, which is what a reference is for.
    return torch.logsumexp(logp_NVt[:, :, None] + dense.log()[None], dim=1)


def _restricted(
    zs: torch.Tensor, logp_t: torch.Tensor, kind: str, beta: float, weights: torch.Tensor
) -> DivergenceOutput:
    """The divergence from the student's tempered logits `zs` to `logp_t`, each token's over the columns
    its target reaches (the student renormalised over them; all of them for a teacher of its vocabulary)."""
    reach = logp_t > float("-inf")
    logp_s = zs.masked_fill(~reach, float("-inf")).log_softmax(-1)
    return _weighted(logp_s, logp_t, kind, beta, weights, reach=reach)


def _most_likely(
    positions: Mapping[int, torch.Tensor], log_probs: Mapping[int, torch.Tensor], labels: torch.Tensor
) -> torch.Tensor:
    """[N] the teacher of each token's set most likely to emit its label (the lowest index on a tie, or
    where the label is negative)."""
    best = torch.full((labels.shape[0],), -1, dtype=torch.long)
    best_score = torch.full((labels.shape[0],), float("-inf"), dtype=torch.float64)
    for t, pos in positions.items():  # ascending: a tie keeps the lower index
        picked = log_probs[t].gather(1, labels[pos].clamp_min(0)[:, None])[:, 0].double()
        score = torch.where(labels[pos] >= 0, picked, 0.0)
        wins = (score > best_score[pos]) | (best[pos] < 0)
        best[pos[wins]], best_score[pos[wins]] = t, score[wins]
    return best
