"""Teacher LM heads on the compute device: this rank's vocabulary slice, under a lifecycle (DESIGN §7).

- `none`: every head resident on the device for the whole run (fastest; memory grows with teachers);
- `offload`: every head kept in host memory, one copied to the device while its tokens are computed;
- `evict`: nothing kept; a head is read from the store each time it is needed.

Under offload and evict at most one head is on the device at a time; `peak_resident` counts it.

A teacher of another tokenizer (DESIGN §13) is served whole on every rank (its vocabulary is not the
student's, so it has no slice of the student's: each rank projects its whole distribution onto its own
slice, `kernel/projected.py`), with its projection onto the student's vocabulary read from the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import torch

from mopd.base.errors import ConfigError
from mopd.store.format.transform import LogitTransform
from mopd.store.reader import TeacherStore
from mopd.tokens.projection import Projection, load_projection

Lifecycle = Literal["none", "offload", "evict"]


def teacher_projections(store: TeacherStore, files: Mapping[str, str] | None = None) -> dict[int, Projection]:
    """Each teacher of another tokenizer's projection onto the store's vocabulary: the store's, or the
    file `train.cross_tokenizer.projection` names for one of its aliases.

    Raises:
        ConfigError: an alias the store does not know, or of a teacher of the store's tokenizer; two
            aliases of one teacher naming different files; a file that is not a projection of its sizes.
    """
    files = dict(files or {})
    known = {alias: t for t in store.teachers for alias in t.aliases}
    for alias in sorted(files):
        if alias not in known or known[alias].tokenizer is None:
            raise ConfigError(
                f"train.cross_tokenizer.projection.{alias}: the store has no teacher of another tokenizer "
                f"under this alias (those it has: {sorted(a for a, t in known.items() if t.tokenizer)})"
            )
    out = {}
    for entry in (t for t in store.teachers if t.tokenizer is not None):
        sizes = dict(
            teacher_vocab=entry.tokenizer.vocab_size, student_vocab=store.manifest.tokenizer.vocab_size
        )
        named = {files[a] for a in entry.aliases if a in files}
        if len(named) > 1:
            raise ConfigError(
                f"train.cross_tokenizer.projection: aliases of teacher {entry.index} name different files "
                f"{sorted(named)}; give one"
            )
        if named:
            path = named.pop()
            out[entry.index] = load_projection(path)
            out[entry.index].check(**sizes, origin=path)
            continue
        source, target, weight = (torch.from_numpy(a) for a in store.projection(entry.index))
        out[entry.index] = Projection(source=source, target=target, weight=weight, **sizes)
    return out


class TeacherHeads:
    """Rows [vocab_start, vocab_stop) of each teacher's head, for `device`.

    Args:
        store: the teacher store (heads are read from it, never from teacher checkpoints).
        teachers: the teacher indices to serve.
        lifecycle: none, offload or evict.
        vocab_start, vocab_stop: this rank's vocabulary slice; rows past a teacher's vocabulary are zeros.
        projection_files: `train.cross_tokenizer.projection` (see `teacher_projections`).
    """

    def __init__(
        self,
        store: TeacherStore,
        teachers: list[int],
        *,
        lifecycle: Lifecycle,
        device: torch.device,
        vocab_start: int,
        vocab_stop: int,
        projection_files: Mapping[str, str] | None = None,
    ) -> None:
        self.store, self.lifecycle, self.device = store, lifecycle, device
        self.vocab_start, self.vocab_stop = vocab_start, vocab_stop
        self.teachers = sorted(teachers)
        self.transforms = {
            t: LogitTransform(store.teacher(t).logit_scale, store.teacher(t).final_logit_softcap)
            for t in self.teachers
        }
        projections = teacher_projections(store, projection_files)
        self.projections = {t: p for t, p in projections.items() if t in self.teachers}
        self._kept: dict[int, torch.Tensor] = {}
        self._resident: set[int] = set()
        self.peak_resident = 0
        self.reads = 0
        if lifecycle == "none":
            self._kept = {t: self._read(t).to(device) for t in self.teachers}
            self._resident = set(self.teachers)
            self.peak_resident = len(self.teachers)
        elif lifecycle == "offload":
            pin = device.type == "cuda"
            self._kept = {t: self._read(t).pin_memory() if pin else self._read(t) for t in self.teachers}

    def _read(self, teacher: int) -> torch.Tensor:
        self.reads += 1
        if teacher in self.projections:  # another tokenizer's teacher: its whole head
            return self.store.lm_head(teacher)
        return self.store.lm_head(teacher, self.vocab_start, self.vocab_stop)

    @property
    def resident_bytes(self) -> int:
        """Bytes of teacher heads held on the device between uses (all of them under `none`)."""
        return self.held_bytes if self.lifecycle == "none" else 0

    @property
    def held_bytes(self) -> int:
        """Bytes of teacher heads this rank keeps between uses, on the device or in host memory."""
        return sum(h.numel() * h.element_size() for h in self._kept.values())

    @property
    def all_on_device(self) -> bool:
        return self.lifecycle == "none"

    def resident(self) -> dict[int, torch.Tensor]:
        """Every head (lifecycle `none` only, where they all stay on the device)."""
        if self.lifecycle != "none":
            raise RuntimeError(f"lifecycle {self.lifecycle!r} keeps heads off the device; use `use(t)`")
        return dict(self._kept)

    @contextmanager
    def use(self, teacher: int) -> Iterator[torch.Tensor]:
        """Teacher `teacher`'s head on the device for the duration of the block."""
        if teacher not in self.teachers:
            raise KeyError(f"teacher {teacher} has no head here (teachers: {self.teachers})")
        if self.lifecycle == "none":
            yield self._kept[teacher]
            return
        if self._resident:
            raise RuntimeError(f"head {sorted(self._resident)} is still on the device; one at a time")
        source = self._kept[teacher] if self.lifecycle == "offload" else self._read(teacher)
        head = source.to(self.device, non_blocking=True)
        self._resident.add(teacher)
        self.peak_resident = max(self.peak_resident, len(self._resident))
        try:
            yield head
        finally:
            self._resident.discard(teacher)
            del head

    @contextmanager
    def use_set(self, teachers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
        """The heads of `teachers` on the device together for the duration of the block: the tokens of
        several teachers need them at once (under `offload` and `evict`, their bytes together)."""
        missing = sorted(set(teachers) - set(self.teachers))
        if missing:
            raise KeyError(f"teacher {missing[0]} has no head here (teachers: {self.teachers})")
        if self.lifecycle == "none":
            yield {t: self._kept[t] for t in teachers}
            return
        if self._resident:
            raise RuntimeError(f"head {sorted(self._resident)} is still on the device; one use at a time")
        heads = {
            t: (self._kept[t] if self.lifecycle == "offload" else self._read(t)).to(
                self.device, non_blocking=True
            )
            for t in teachers
        }
        self._resident.update(teachers)
        self.peak_resident = max(self.peak_resident, len(self._resident))
        try:
            yield heads
        finally:
            self._resident.clear()
            del heads
