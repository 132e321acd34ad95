"""The store loader: microbatch contents, epoch coverage across ranks, resumable state, thread hygiene."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from mopd.store.reader import TeacherStore, open_store
from mopd.train.data.loader import IGNORE, StoreLoader, read_microbatches
from mopd.train.data.order import LoaderState
from tests.train.world import World


def loader(store: TeacherStore, **kwargs: int) -> StoreLoader:
    options = {"micro_batch_tokens": 256, "global_batch_tokens": 700, **kwargs}
    return StoreLoader(store, np.arange(store.num_rows), **options)


def test_a_microbatch_holds_its_rows_padded_to_its_own_longest(world: World) -> None:
    store = open_store(world.store)
    rows = np.array([5, 2, 9])
    mb = read_microbatches(store, [rows])[0]
    lengths = store.lengths[rows]
    assert mb.input_ids.shape == (3, lengths.max())
    for b, r in enumerate(rows):
        row = store.row(int(r))
        n = lengths[b]
        assert torch.equal(mb.input_ids[b, :n], row.input_ids) and not mb.attention_mask[b, n:].any()
        assert torch.equal(mb.loss_mask[b, :n], row.loss_mask) and not mb.loss_mask[b, n:].any()
        assert torch.equal(
            mb.labels[mb.token_row == b],
            torch.cat([row.input_ids[1:], torch.tensor([IGNORE])])[row.loss_mask],
        )
    # Teacher t's hidden states: its rows' trained positions, in token order.
    for t in set(mb.teacher_index.tolist()):
        expected = [
            store.hidden(int(r))[store.row(int(r)).loss_mask]
            for r in rows
            if store.row(int(r)).teacher_index == t
        ]
        assert torch.equal(mb.teacher_hidden[t], torch.cat(expected))
    assert mb.teacher_index.tolist() == [store.row(int(rows[b])).teacher_index for b in mb.token_row.tolist()]


def test_a_stage_without_the_loss_reads_no_teacher_states(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline stage before the last gets the same tokens and masks and never reads hidden states."""
    store = open_store(world.store)
    rows = np.array([5, 2, 9])
    full = read_microbatches(store, [rows])[0]
    monkeypatch.setattr(store, "hiddens", lambda rows: pytest.fail(f"read teacher states of rows {rows}"))
    bare = read_microbatches(store, [rows], with_teacher_states=False)[0]
    assert bare.teacher_hidden == {}
    for name in ("input_ids", "attention_mask", "loss_mask", "teacher_index", "token_row", "labels"):
        assert torch.equal(getattr(bare, name), getattr(full, name)), name


def test_an_epoch_trains_every_row_once_across_ranks(world: World) -> None:
    store = open_store(world.store)
    seen: list[int] = []
    for rank in range(2):
        rank_loader = loader(store, dp_rank=rank, dp_size=2)
        for step in rank_loader.steps(LoaderState(seed=3)):
            seen += [int(r) for mb in step.microbatches for r in mb.rows]
            if step.state_after.epoch == 1:
                break
    assert sorted(seen) == list(range(store.num_rows))


def test_a_rank_without_rows_in_a_step_reads_no_microbatches(world: World) -> None:
    """A step of fewer rows than ranks leaves a rank none: it gets an empty step, not an error."""
    assert read_microbatches(open_store(world.store), []) == []


def test_resuming_from_a_state_continues_the_same_sequence(world: World) -> None:
    store = open_store(world.store)
    rows_of = lambda step: [mb.rows.tolist() for mb in step.microbatches]  # noqa: E731
    steps = list(itertools.islice(loader(store).steps(LoaderState(seed=1)), 12))
    assert steps[-1].state_after.epoch >= 1  # the 12 steps cross an epoch boundary
    head = list(itertools.islice(loader(store).steps(LoaderState(seed=1)), 5))
    tail = [rows_of(s) for s in itertools.islice(loader(store).steps(head[-1].state_after), 7)]
    assert [rows_of(s) for s in steps] == [rows_of(s) for s in head] + tail


def test_a_read_error_in_the_background_reaches_the_trainer(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(world.store)
    calls = itertools.count()

    def failing_hiddens(rows: np.ndarray) -> list[torch.Tensor]:
        if next(calls) == 3:
            raise OSError("disk went away")
        return TeacherStore.hiddens(store, rows)

    monkeypatch.setattr(store, "hiddens", failing_hiddens)
    with pytest.raises(OSError, match="disk went away"):
        for _ in loader(store).steps(LoaderState(seed=0)):
            pass


def test_closing_the_stream_stops_the_reader_thread(world: World) -> None:
    steps = loader(open_store(world.store)).steps(LoaderState(seed=0))
    next(steps)
    assert any(t.name == "mopd-loader" for t in threading.enumerate())
    steps.close()
    assert not any(t.name == "mopd-loader" for t in threading.enumerate())
