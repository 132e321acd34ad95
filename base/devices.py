"""The compute device a config names: `auto` is CUDA when present, else the CPU."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def rank_device(device: str) -> torch.device:
    """The device of this process: `device` resolved, and on CUDA with an index: this node's GPU of the
    process's local rank under torchrun (a plain `cuda` would put every process on GPU 0), else GPU 0
    (`torch.cuda.set_device` refuses a device without an index)."""
    where = resolve_device(device)
    if where.type == "cuda" and where.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return where
