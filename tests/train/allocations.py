"""Records the largest tensor any aten op (factories included) creates while a block runs."""

from __future__ import annotations

from typing import Any

import torch
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
