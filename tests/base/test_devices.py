"""The device each process computes on (`train.device`, `precompute.device`)."""

from __future__ import annotations

import pytest
import torch

from mopd.base.devices import rank_device


def test_each_process_gets_its_local_gpu_and_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device("cuda") == torch.device("cuda", 0)  # set_device refuses a device without index
    assert rank_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert rank_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert rank_device("cpu") == torch.device("cpu")
