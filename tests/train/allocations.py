"""Records the largest tensor any aten op (factories included) creates while a block runs."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestAllocation(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.largest_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.numel() > self.largest:
                self.largest, self.largest_op = item.numel(), str(func)
        return out


class LargestVocabAllocation(TorchDispatchMode):
    """The largest tensor created with a dimension of the vocabulary's size (logits-shaped tensors)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.largest = 0
        self.largest_shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if (
                isinstance(item, torch.Tensor)
                and self.vocab_size in item.shape
                and item.numel() > self.largest
            ):
                self.largest, self.largest_shape = item.numel(), tuple(item.shape)
        return out


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes held at once by storages that ops create while a block runs: what a call needs
    above its inputs, counted exactly, whatever the allocator keeps or returns.

    An op's output counts when its storage is not one of its inputs' (views and `out=` results are not
    new memory); it stops counting when the last tensor using it is gone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[int, tuple[int, StorageWeakRef]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {
            item.untyped_storage().data_ptr()
            for item in tree_flatten((args, kwargs))[0]
            if isinstance(item, torch.Tensor)
        }
        self._live = {ptr: held for ptr, held in self._live.items() if not held[1].expired()}
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                storage = item.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in given and ptr not in self._live and storage.nbytes():
                    self._live[ptr] = (storage.nbytes(), StorageWeakRef(storage))
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self._live.values()))
        return out
