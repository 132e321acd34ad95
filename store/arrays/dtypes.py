"""Tensors to and from their on-disk representation: bf16 as uint16 bit patterns, bit-exact both ways.

Kept apart from `write.py` so that the store's metadata paths (`verify-manifest`, `inspect`) never
import torch.
"""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_logical_dtype(dtype: torch.dtype) -> str:
    names = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"tensors of dtype {dtype} cannot be stored; use bfloat16 or float32")
    return names[dtype]


def to_storage(tensor: torch.Tensor, logical_dtype: str) -> np.ndarray:
    """A CPU numpy view of `tensor` in its on-disk representation (no rounding: dtypes must match)."""
    tensor = tensor.detach().cpu().contiguous()
    if torch_logical_dtype(tensor.dtype) != logical_dtype:
        raise ValueError(f"tensor is {tensor.dtype}, the array stores {logical_dtype}")
    if logical_dtype == "bfloat16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_storage(array: np.ndarray, logical_dtype: str) -> torch.Tensor:
    """The torch tensor whose on-disk representation is `array`."""
    array = np.ascontiguousarray(array)
    if logical_dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
