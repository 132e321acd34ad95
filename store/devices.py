"""The compute device a config names: `auto` is CUDA when present, else the CPU."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def rank_device(device: str) -> torch.device:
    """The device of this process: `device` resolved, and on CUDA under torchrun this node's GPU of the
    process's local rank (a plain `cuda` would put every process on GPU 0)."""
    where = resolve_device(device)
    if where.type == "cuda" and where.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return where
