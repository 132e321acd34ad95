"""The compute device a config names: `auto` is CUDA when present, else the CPU."""

from __future__ import annotations

import os

import torch

from mopd.base.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_device(name: str, *, key: str) -> None:
    """Refuses a CUDA device this machine does not have, naming the config `key` (a config may name a
    GPU and be read elsewhere, so this runs where the device is used, not when the config loads).

    Raises:
        ConfigError: `cuda` without a CUDA device, or `cuda:N` past the last one.
    """
    where = resolve_device(name)
    if where.type != "cuda":
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(f"{key}: {name!r} needs a CUDA device and this machine has none; use cpu or auto")
    if where.index is not None and where.index >= count:
        raise ConfigError(
            f"{key}: {name!r}, but this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )


def rank_device(device: str) -> torch.device:
    """The device of this process: `device` resolved, and on CUDA with an index: this node's GPU of the
    process's local rank under torchrun (a plain `cuda` would put every process on GPU 0), else GPU 0
    (`torch.cuda.set_device` refuses a device without an index)."""
    where = resolve_device(device)
    if where.type == "cuda" and where.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return where
