"""Teacher LM heads on the compute device: this rank's vocabulary slice, under a lifecycle (DESIGN §7).

- `none`: every head resident on the device for the whole run (fastest; memory grows with teachers);
- `offload`: every head kept in host memory, one copied to the device while its tokens are computed;
- `evict`: nothing kept; a head is read from the store each time it is needed.

Under offload and evict at most one head is on the device at a time; `peak_resident` counts it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from mopd.store.format.transform import LogitTransform
from mopd.store.reader import TeacherStore

Lifecycle = Literal["none", "offload", "evict"]


class TeacherHeads:
    """Rows [vocab_start, vocab_stop) of each teacher's head, for `device`.

    Args:
        store: the teacher store (heads are read from it, never from teacher checkpoints).
        teachers: the teacher indices to serve.
        lifecycle: none, offload or evict.
        vocab_start, vocab_stop: this rank's vocabulary slice; rows past a teacher's vocabulary are zeros.
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
    ) -> None:
        self.store, self.lifecycle, self.device = store, lifecycle, device
        self.vocab_start, self.vocab_stop = vocab_start, vocab_stop
        self.teachers = sorted(teachers)
        self.transforms = {
            t: LogitTransform(store.teacher(t).logit_scale, store.teacher(t).final_logit_softcap)
            for t in self.teachers
        }
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
