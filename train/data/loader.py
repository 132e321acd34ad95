"""Streams a teacher store to one data-parallel rank: steps of microbatches, read ahead in a thread.

The order comes from `data.order` (pure functions of lengths, seed, epoch and rank), so the loader's
whole state is a `LoaderState`. A microbatch holds its rows padded only to its own longest row, and each
teacher's hidden states at the trained positions only (the kernel never needs the others).

Token order: the trained tokens of a microbatch are its loss-masked positions in row-major order
(`loss_mask[b, t]` trains the prediction made at position t, of token t + 1). `teacher_hidden[t]` holds
teacher t's trained tokens in that same order, which is what `linear_divergence` expects. A teacher of
another tokenizer (DESIGN §13) has states at its own positions: `teacher_hidden[t]` holds, for each of
its trained tokens that an aligned teacher position supervises (`aligned`), that position's state; with
`spans`, the microbatch also carries its trained spans (`Spans`) for the span log-likelihood match.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Collection, Generator, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mopd.store.format.layout import set_mask
from mopd.store.reader import Row, StoredAlignment, TeacherStore
from mopd.train.data.order import LoaderState, epoch_steps, rank_microbatches

IGNORE = -100  # label of a trained position with no next token


@dataclass(frozen=True)
class TeacherSpans:
    """A teacher of another tokenizer's side of a microbatch's trained spans."""

    hidden: torch.Tensor  # [M, H] its states at its positions inside the spans
    targets: torch.Tensor  # [M] the teacher's own token each of them predicts
    span: torch.Tensor  # [M] the span of each


@dataclass(frozen=True)
class Spans:
    """A microbatch's trained spans (DESIGN §13): runs of the same bytes that are more than one token
    on either side (a span of one token on each side is an aligned position, which the divergence
    supervises), numbered 0 … count − 1 over the microbatch."""

    count: int
    of_token: torch.Tensor  # [N] the span of each trained token, −1 for none
    teacher: dict[int, TeacherSpans]

    def to(self, device: torch.device) -> Spans:
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        teacher = {
            t: TeacherSpans(move(s.hidden), move(s.targets), move(s.span)) for t, s in self.teacher.items()
        }
        return Spans(self.count, move(self.of_token), teacher)


def trained_spans(
    alignment: StoredAlignment, loss_mask: np.ndarray | torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row's trained spans, numbered from 0: (the span of each trained position, −1 for none; the
    teacher positions inside them; the span of each)."""
    student = alignment.student_span[np.asarray(loss_mask, dtype=bool)]
    teacher_pos = np.flatnonzero(alignment.teacher_span >= 0)
    teacher = alignment.teacher_span[teacher_pos]
    count = int(max(student.max(initial=-1), teacher.max(initial=-1))) + 1
    keep = (np.bincount(student[student >= 0], minlength=count) > 1) | (
        np.bincount(teacher, minlength=count) > 1
    )
    number = np.where(keep, np.cumsum(keep) - 1, -1)
    kept = keep[teacher]
    return np.where(student >= 0, number[student.clip(0)], -1), teacher_pos[kept], number[teacher[kept]]


@dataclass(frozen=True)
class MicroBatch:
    rows: np.ndarray  # [B] store row ids
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool, False on padding
    teacher_index: torch.Tensor  # [N] teacher index of each trained token
    token_row: torch.Tensor  # [N] batch position of each trained token's row
    labels: torch.Tensor  # [N] the token each trained position predicts (IGNORE where none)
    teacher_hidden: dict[int, torch.Tensor]  # teacher -> [N_t, H_t], the trained tokens it scores, in order
    # [N] bool: the token's teacher of another tokenizer, where its row has one (at most one), has a state
    # there (an aligned position); True where the row has none. None: every token has every state.
    aligned: torch.Tensor | None = None
    spans: Spans | None = None  # read with `spans=True` where the microbatch has rows of such teachers
    # [N] int64: the teachers that score each trained token (`store.format.layout.set_mask` bits), in a
    # store whose rows may have several (DESIGN §14); None in one whose rows have one each.
    teacher_set: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_trained(self) -> int:
        return int(self.teacher_index.shape[0])

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            rows=self.rows,
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            loss_mask=move(self.loss_mask),
            teacher_index=self.teacher_index,
            token_row=move(self.token_row),
            labels=move(self.labels),
            teacher_hidden={t: move(h) for t, h in self.teacher_hidden.items()},
            aligned=self.aligned,
            spans=None if self.spans is None else self.spans.to(device),
            teacher_set=self.teacher_set,
        )


@dataclass(frozen=True)
class Step:
    """One optimiser step's share for this rank, and the loader state once it is trained."""

    microbatches: list[MicroBatch]
    state_after: LoaderState


def read_microbatches(
    store: TeacherStore,
    microbatch_rows: list[np.ndarray],
    *,
    with_teacher_states: bool = True,
    spans: bool = False,
) -> list[MicroBatch]:
    """Reads a step's microbatches (tokens, masks, teacher index, hidden states at trained positions).

    The step's rows are read in one batched call per array, so every stored chunk they touch is
    decoded once however the rows fall into microbatches. Without `with_teacher_states` (a pipeline stage
    that computes no loss) the teacher states are not read; with `spans`, a row of a teacher of another
    tokenizer gives its trained spans too (its whole alignment is read, not only its aligned positions).
    """
    if not microbatch_rows:  # a step with fewer rows than data-parallel ranks leaves some with none
        return []
    every = np.concatenate(microbatch_rows).astype(np.int64)
    stored = store.rows(every)
    trained = np.array([with_teacher_states and bool(row.loss_mask.any()) for row in stored], dtype=bool)
    hidden_of = _teacher_states(store, every, stored, trained)
    # A row with a teacher of another tokenizer: which of its states each position reads (−1: none).
    others = {t.index for t in store.teachers if t.tokenizer is not None}
    read = store.alignment if spans else store.aligned
    aligned_of = {k: read(int(every[k])) for k in hidden_of if others & set(stored[k].teachers)}
    out, at = [], 0
    for rows in microbatch_rows:
        positions = range(at, at + len(rows))
        out.append(
            _collate(
                rows,
                [stored[k] for k in positions],
                [hidden_of.get(k) for k in positions],
                [aligned_of.get(k) for k in positions],
                sets=store.teacher_sets is not None,
                others=others,
            )
        )
        at += len(rows)
    return out


def _teacher_states(
    store: TeacherStore, every: np.ndarray, stored: list[Row], trained: np.ndarray
) -> dict[int, dict[int, torch.Tensor]]:
    """The states of each trained row (by position in `every`), by teacher: one batched read per
    teacher."""
    if not trained.any():
        return {}
    positions = np.flatnonzero(trained)
    if store.teacher_sets is None:
        states = store.hiddens(every[positions])
        return {k: {stored[k].teacher_index: s} for k, s in zip(positions.tolist(), states, strict=True)}
    out: dict[int, dict[int, torch.Tensor]] = {k: {} for k in positions.tolist()}
    for t in sorted({t for k in positions for t in stored[k].teachers}):
        mine = [k for k in positions.tolist() if t in stored[k].teachers]
        for k, state in zip(mine, store.hiddens(every[mine], teacher=t), strict=True):
            out[k][t] = state
    return out


def _collate(
    rows: np.ndarray,
    stored: list[Row],
    states: list[dict[int, torch.Tensor] | None],
    alignments: list[StoredAlignment | np.ndarray | None] | None = None,
    *,
    sets: bool = False,
    others: Collection[int] = (),
) -> MicroBatch:
    """Pads the rows to the longest and keeps each row's teacher states (by teacher) at its trained
    positions (a teacher of another tokenizer, `others`, a row has at most one: the states of its
    positions aligned with them, and where its whole alignment is given, its trained spans); with `sets`,
    each token's set of teachers."""
    alignments = alignments or [None] * len(stored)
    longest = max(row.input_ids.shape[0] for row in stored)
    input_ids = torch.zeros(len(stored), longest, dtype=torch.long)
    attention = torch.zeros(len(stored), longest, dtype=torch.long)
    loss_mask = torch.zeros(len(stored), longest, dtype=torch.bool)
    labels = torch.full((len(stored), longest), IGNORE, dtype=torch.long)
    hidden: dict[int, list[torch.Tensor]] = {}
    has_state: list[torch.Tensor] = []
    spans = _SpanParts()
    for b, (row, state) in enumerate(zip(stored, states, strict=True)):
        length = row.input_ids.shape[0]
        input_ids[b, :length] = row.input_ids
        attention[b, :length] = 1
        loss_mask[b, :length] = row.loss_mask
        labels[b, : length - 1] = row.input_ids[1:]
        alignment = alignments[b]
        trained = int(row.loss_mask.sum())
        if alignment is None:
            has_state.append(torch.ones(trained, dtype=torch.bool))
            for t, teacher_state in (state or {}).items():
                hidden.setdefault(t, []).append(teacher_state[row.loss_mask])
            spans.skip(trained)
            continue
        whole = alignment if isinstance(alignment, StoredAlignment) else None
        at = torch.as_tensor(alignment if whole is None else whole.aligned)[row.loss_mask]
        has_state.append(at >= 0)
        other = next(t for t in row.teachers if t in others)
        for t, teacher_state in (state or {}).items():
            kept = teacher_state[at[at >= 0]] if t == other else teacher_state[row.loss_mask]
            hidden.setdefault(t, []).append(kept)
        if whole is not None and state is not None:
            spans.add(other, state[other], whole, row.loss_mask)
        else:
            spans.skip(trained)
    row_teacher_index = torch.tensor([row.teacher_index for row in stored], dtype=torch.long)
    row_set = torch.tensor([set_mask(row.teachers) for row in stored], dtype=torch.long) if sets else None
    token_row = loss_mask.nonzero()[:, 0]
    return MicroBatch(
        rows=np.asarray(rows, dtype=np.int64),
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        teacher_index=row_teacher_index[token_row],
        token_row=token_row,
        labels=labels[loss_mask],
        teacher_hidden={t: torch.cat(parts) for t, parts in hidden.items()},
        aligned=None if all(a is None for a in alignments) else torch.cat(has_state),
        spans=spans.batch(),
        teacher_set=None if row_set is None else row_set[token_row],
    )


class _SpanParts:
    """The rows' trained spans as `_collate` meets them, numbered over the microbatch."""

    def __init__(self) -> None:
        self.count, self.seen = 0, False
        self.of_token: list[np.ndarray] = []
        self.teacher: dict[int, list[tuple[torch.Tensor, np.ndarray, np.ndarray]]] = {}

    def skip(self, trained: int) -> None:
        self.of_token.append(np.full(trained, -1, dtype=np.int64))

    def add(
        self, teacher: int, state: torch.Tensor, alignment: StoredAlignment, loss_mask: torch.Tensor
    ) -> None:
        self.seen = True
        of_token, positions, span = trained_spans(alignment, loss_mask)
        self.of_token.append(np.where(of_token >= 0, of_token + self.count, -1))
        targets = alignment.token_ids[positions + 1]
        self.teacher.setdefault(teacher, []).append((state[positions], targets, span + self.count))
        self.count += int(max(of_token.max(initial=-1), span.max(initial=-1))) + 1

    def batch(self) -> Spans | None:
        if not self.seen:
            return None
        teacher = {
            t: TeacherSpans(
                hidden=torch.cat([h for h, _, _ in parts]),
                targets=torch.from_numpy(np.concatenate([x for _, x, _ in parts])),
                span=torch.from_numpy(np.concatenate([s for _, _, s in parts])),
            )
            for t, parts in self.teacher.items()
        }
        return Spans(self.count, torch.from_numpy(np.concatenate(self.of_token)), teacher)


class StoreLoader:
    """Yields this rank's steps from `state` on, reading `prefetch` steps ahead in a background thread.

    Args:
        store: the opened teacher store.
        rows: the store rows to train on (the rest, e.g. held-out rows, are never read).
        seed, micro_batch_tokens, global_batch_tokens: the data order (see `data.order`).
        dp_rank, dp_size: this rank's place in the data-parallel group.
        prefetch: steps read ahead.
        with_teacher_states: read the teacher hidden states (only ranks that compute the loss need them).
        spans: read the trained spans of rows of teachers of other tokenizers (`read_microbatches`).
    """

    def __init__(
        self,
        store: TeacherStore,
        rows: np.ndarray,
        *,
        micro_batch_tokens: int,
        global_batch_tokens: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        prefetch: int = 2,
        with_teacher_states: bool = True,
        spans: bool = False,
    ) -> None:
        if rows.shape[0] == 0:
            raise ValueError("no rows to train on")
        self.store = store
        self.rows = np.asarray(rows, dtype=np.int64)
        self.lengths = store.lengths[self.rows]
        self.micro_batch_tokens = micro_batch_tokens
        self.global_batch_tokens = global_batch_tokens
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.prefetch = prefetch
        self.with_teacher_states = with_teacher_states
        self.spans = spans

    def _plan(self, state: LoaderState) -> Iterator[tuple[list[np.ndarray], LoaderState]]:
        epoch, position = state.epoch, state.step_in_epoch
        while True:
            steps = epoch_steps(
                self.lengths, seed=state.seed, epoch=epoch, global_batch_tokens=self.global_batch_tokens
            )
            for k in range(position, len(steps)):
                after = LoaderState(state.seed, epoch, k + 1) if k + 1 < len(steps) else None
                micro = rank_microbatches(
                    steps[k],
                    self.lengths,
                    dp_rank=self.dp_rank,
                    dp_size=self.dp_size,
                    micro_batch_tokens=self.micro_batch_tokens,
                )
                yield [self.rows[m] for m in micro], after or LoaderState(state.seed, epoch + 1, 0)
            epoch, position = epoch + 1, 0

    def steps(self, state: LoaderState) -> Generator[Step, None, None]:
        """This rank's steps from `state` on, forever (epochs follow one another)."""
        out: queue.Queue[Step | BaseException] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for micro_rows, after in self._plan(state):
                    read = read_microbatches(
                        self.store, micro_rows, with_teacher_states=self.with_teacher_states, spans=self.spans
                    )
                    step = Step(read, after)
                    while not stop.is_set():
                        try:
                            out.put(step, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as err:  # handed to the consumer, which re-raises it
                out.put(err)

        thread = threading.Thread(target=produce, name="mopd-loader", daemon=True)
        thread.start()
        try:
            while True:
                item = out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=10)
