"""A training session: what training and evaluation share — the process groups, the store, the student,
its teachers' heads and the objective — built by one function, `open_session`, and used as a context
manager.

The session owns every process group it starts (the world's, under torchrun; megatron-core's
model-parallel state and, without torchrun, its one-rank world) and closes them on every exit path, a
failure while it is being built included. `Trainer` adds the optimiser, the schedule and the data order
to a session; `evaluate_student` adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from mopd.base.devices import check_device, rank_device
from mopd.base.errors import ConfigError, ManifestError
from mopd.base.fsio import object_url
from mopd.config.mopd_config import MopdConfig
from mopd.config.paths import TRAIN, check_paths
from mopd.config.train import TrainConfig
from mopd.store.format.manifest import aligned_shares
from mopd.store.format.teachers import TeacherIdentity
from mopd.store.reader import TeacherStore, open_store
from mopd.tokens.alignment import shares_line
from mopd.train.backends.groups import RankGroup
from mopd.train.backends.protocol import LossFn, TrainStudent
from mopd.train.backends.registry import backend
from mopd.train.data.loader import MicroBatch, read_microbatches
from mopd.train.data.order import rank_microbatches
from mopd.train.heads import TeacherHeads, teacher_projections
from mopd.train.objective import Objective, StepStats, teacher_weights
from mopd.train.report.metrics import EvalRecord
from mopd.train.vocabulary import distilled_vocabulary

Log = Callable[[str], None]


def _silent(_line: str) -> None:
    pass


@dataclass
class Session:
    """One rank's part of a training run, up to the loss (see the module docstring)."""

    config: TrainConfig
    device: torch.device
    world: RankGroup  # every process of the run
    store: TeacherStore
    student: TrainStudent
    # The student's data-parallel replicas: the world on the hf backend, one rank of each
    # model-parallel group on the megatron backend. The loader deals rows to them.
    replicas: RankGroup
    heads: TeacherHeads
    objective: Objective
    heads_by_rank: list[int]  # bytes of teacher heads each rank of the world holds (device or host)
    log: Log  # rank 0's lines; the other ranks' are dropped
    exits: ExitStack = field(repr=False)  # closes what the session started, last first

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Releases the student and every process group the session started (a second call does
        nothing)."""
        self.exits.close()

    @property
    def num_teachers(self) -> int:
        return max(t.index for t in self.store.manifest.teachers) + 1

    @cached_property
    def projection_fingerprints(self) -> dict[int, str]:
        """Each teacher of another tokenizer's projection, by fingerprint (the run record's)."""
        files = self.config.cross_tokenizer.projection
        return {t: p.fingerprint for t, p in teacher_projections(self.store, files).items()}

    @cached_property
    def teacher_sets(self) -> list[int]:
        """The sets of several teachers the store's rows have (`layout.set_mask` bits), ascending."""
        sets = self.store.teacher_sets
        if sets is None:
            return []
        return sorted(int(m) for m in np.unique(sets) if m & (m - 1))

    @property
    def cross_teachers(self) -> list[int]:
        """The teachers of other tokenizers than the student's (DESIGN §13)."""
        return [t.index for t in self.store.manifest.teachers if t.tokenizer is not None]

    @property
    def teacher_list(self) -> list[TeacherIdentity]:
        return self.store.manifest.teacher_list()

    def loss_fn(
        self, stats: StepStats, norm_of: Callable[[MicroBatch], torch.Tensor], *, train: bool
    ) -> LossFn:
        """The loss of one microbatch as the student's forward_backward calls it, its per-token
        divergences gathered into `stats`; `norm_of` gives each trained token's weight."""

        def loss_fn(hidden: torch.Tensor, head: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, None]:
            mb = mb.to(self.device)
            terms = self.objective(hidden, head if train else head.detach(), mb, norm_of(mb))
            if self.student.reports:
                loss = terms.loss if train else torch.zeros(())
                # Tokens of a teacher of another tokenizer with no aligned teacher position carry no
                # divergence: they are left out of its mean.
                per_token, teacher_index = terms.per_token, mb.teacher_index
                stats.add_alignment(mb)
                if mb.aligned is not None:
                    per_token = per_token[mb.aligned.to(per_token.device)]
                    teacher_index = teacher_index[mb.aligned.cpu()]
                if terms.reported is not None:  # tokens of several teachers: keyed by their targets
                    per_token, teacher_index = terms.reported[0], stats.keys(terms.reported[1])
                if terms.shares is not None:
                    stats.add_shares(*terms.shares)
                stats.add(
                    per_token,
                    teacher_index,
                    loss,
                    terms.ce if train else None,
                    span=terms.span if train else None,
                )
            return terms.loss, None

        return loss_fn

    @torch.no_grad()
    def evaluate(self, rows: np.ndarray, *, step: int) -> EvalRecord:
        """Mean divergence per trained token of `rows` (store rows), by teacher (no weighting, no CE)."""
        self.student.train(False)
        stats = StepStats(self.num_teachers, self.cross_teachers, self.teacher_sets)
        microbatches = read_microbatches(
            self.store,
            rank_microbatches(
                rows,
                self.store.lengths,
                dp_rank=self.replicas.rank,
                dp_size=self.replicas.size,
                micro_batch_tokens=self.config.batch.micro_batch_tokens,
            ),
            with_teacher_states=self.student.holds_loss,
        )
        zero = lambda mb: torch.zeros(mb.num_trained, device=self.device)  # noqa: E731
        self.student.forward_backward(microbatches, self.loss_fn(stats, zero, train=False), forward_only=True)
        stats.reduce(self.world)
        self.student.train()
        return EvalRecord(split="eval", step=step, **stats.divergences())


def _store_lines(store: TeacherStore, span_weight: float) -> list[str]:
    """What the run trains on: the store's size, and one line per teacher of another tokenizer with the
    shares of its trained positions it supervises and whether the span loss trains those inside spans."""
    manifest = store.manifest
    names = {t.index: "+".join(t.aliases) for t in manifest.teachers}
    spans = f"; span loss weight {span_weight:g}" if span_weight > 0 else "; span loss off"
    return [
        f"store {store.root}: {store.num_rows:,} rows, {manifest.dataset.num_tokens:,} tokens, "
        f"{len(manifest.teachers)} teachers",
        *(shares_line(names[t], *shares) + spans for t, shares in aligned_shares(manifest).items()),
    ]


def setup_line(tc: TrainConfig, world_size: int) -> str:
    """The settings that decide how the student trains, as they take effect: backend and its layout,
    processes, weights and compute precision, activation checkpointing."""
    parallel = tc.parallel
    model_parallel = parallel.tp * parallel.pp
    layout = {
        "megatron": f" (tp {parallel.tp} × pp {parallel.pp} × dp {world_size // model_parallel})",
        "fsdp": f" ({parallel.dp_replicate} replicas of {world_size // parallel.dp_replicate} shards)"
        if parallel.dp_replicate > 1
        else f" (sharded over {world_size})",
        "hf": f" (data parallel over {world_size})" if world_size > 1 else "",
    }[tc.backend]
    compute = "bf16 autocast over fp32 weights" if tc.mixed_precision == "bf16" else f"{tc.dtype} throughout"
    checkpointing = "on" if tc.activation_checkpointing else "off"
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    return f"backend {tc.backend}{layout}, {processes}, {compute}, activation checkpointing {checkpointing}"


def _open_store(config: MopdConfig, store_path: str | Path | None) -> TeacherStore:
    """The store, and every path the run reads, checked at once before the student loads (a teacher the
    store records may be absent: its head is in the store); a refusal names the setting."""
    key, path = ("--store", str(store_path)) if store_path else ("store.path", config.store.path)
    store: TeacherStore | None = None
    try:
        store = open_store(path, config.store.options)
    except ManifestError as err:
        if object_url(path) or Path(path).exists():
            raise ManifestError(f"{key}: {err}") from err
    recorded = {t.checkpoint for t in store.manifest.teachers} if store is not None else set()
    check_paths(config, TRAIN, recorded=recorded, also=[] if store is not None else [(key, path)])
    assert store is not None, "check_paths refuses a store that is not there"
    return store


def open_session(config: MopdConfig, *, store_path: str | Path | None = None, log: Log = print) -> Session:
    """Builds the session of `config`'s `train` section over its store (or `store_path`).

    Raises:
        ConfigError: no train section, or a student, store or setting that does not fit; MopdError
            subclasses for a store that cannot be read. Whatever the session had started is closed.
    """
    if config.train is None:
        raise ConfigError("the config has no `train` section; add one (see DESIGN §9) to train")
    tc = config.train
    with ExitStack() as exits:
        check_device(tc.device, key="train.device")
        device = rank_device(tc.device)
        entry = backend(tc.backend)
        world = exits.enter_context(RankGroup.from_environment(device, always=entry.needs_process_group))
        log = log if world.rank == 0 else _silent
        # torch's global generator, seeded for the run: what the student's own forward draws (dropout)
        # comes from it, and a checkpoint saves and restores it (`checkpoint.state`), so the process's
        # generator is the run's. The data order has its own (`data.order`).
        torch.manual_seed(tc.seed)
        store = _open_store(config, store_path)
        manifest = store.manifest
        for line in _store_lines(store, tc.cross_tokenizer.span_weight):
            log(line)
        log(f"loading student {tc.student} on {device}: {setup_line(tc, world.size)}")
        student = entry.open_student(tc, device, world, exits)
        exits.callback(student.close)
        student.check_compatible(manifest)
        vocab_size = distilled_vocabulary(manifest, student_rows=student.output_rows, override=tc.vocab_size)
        vocab_start, vocab_stop = student.vocab_slice(vocab_size)
        heads = TeacherHeads(
            store,
            [t.index for t in manifest.teachers] if student.holds_loss else [],
            lifecycle=tc.lm_head_lifecycle,
            device=device,
            vocab_start=vocab_start,
            vocab_stop=vocab_stop,
            projection_files=tc.cross_tokenizer.projection,
        )
        objective = Objective(
            tc.divergence,
            heads,
            teacher_weights(manifest, tc.teacher_weights),
            vocab_size,
            student,
            vocab_slice=(vocab_start, vocab_stop),
            device=device,
            span_weight=tc.cross_tokenizer.span_weight,
            ensemble=tc.ensemble.method,
        )
        heads_by_rank = _account_heads(tc, heads, world, device, log)
        session = Session(
            tc,
            device,
            world,
            store,
            student,
            student.data_parallel(),
            heads,
            objective,
            heads_by_rank,
            log,
            exits.pop_all(),
        )
    return session


def _account_heads(
    tc: TrainConfig, heads: TeacherHeads, world: RankGroup, device: torch.device, log: Log
) -> list[int]:
    """Bytes of teacher heads each rank of the world holds (device or host), logged by rank 0."""
    held = world.all_gather_object(heads.held_bytes)
    if tc.lm_head_lifecycle == "none":
        log(
            f"lm_head_lifecycle none: {len(heads.teachers)} teacher heads stay on {device} "
            f"({heads.resident_bytes / 2**20:.1f} MiB); this grows linearly with the teacher count"
        )
    if world.enabled:
        log(
            "teacher heads held by rank: "
            + ", ".join(f"{rank}: {size / 2**20:.2f} MiB" for rank, size in enumerate(held))
        )
    return held
